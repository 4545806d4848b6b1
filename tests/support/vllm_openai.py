"""Real ``vllm serve`` OpenAI servers (CPU build) for tests, started as operators start
them (``python -m vllm.entrypoints.openai.api_server``), plus small HTTP helpers.

    server = VllmServer(model, log, kv_transfer=transfer_config, tokenizer=False)
    server.wait_healthy()
    body = post_json(server.url + "/v1/completions", {...})
    server.kill()        # SIGKILL: a crash; the port refuses connections
    server.start()       # the same port and flags again (wait_healthy before use)
    server.close()
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from support.redis_server import free_port

STARTUP_S = 600  # several servers starting at once on a 2-core machine


def http(url: str, payload: dict | None = None, timeout: float = 120) -> bytes:
    """GET ``url``, or POST ``payload`` as JSON; the body. Raises on a non-2xx answer."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def post_json(url: str, payload: dict, timeout: float = 120) -> dict:
    return json.loads(http(url, payload, timeout))


def metric(text: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (all label sets)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


class VllmServer:
    """``vllm serve`` on a free loopback port, float32, eager, a small KV cache.

    Args:
        model: a local model directory.
        log: the server's stdout and stderr.
        kv_transfer: vLLM's ``--kv-transfer-config`` (None: no connector).
        tokenizer: load the model's tokenizer (False: ``--skip-tokenizer-init``, prompts
            as token ids only).
        block_size: vLLM's block size.
        kv_cache_memory_bytes: the KV cache's size.
        args: more ``vllm serve`` flags.
        env: more environment variables for the server.
    """

    def __init__(
        self,
        model: Path,
        log: Path,
        *,
        kv_transfer: dict | None = None,
        tokenizer: bool = False,
        block_size: int = 32,
        kv_cache_memory_bytes: int = 128 << 20,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--block-size",
            str(block_size),
            "--max-model-len",
            "2048",
            "--kv-cache-memory-bytes",
            str(kv_cache_memory_bytes),
            "--enforce-eager",
        ]
        if not tokenizer:
            self.command.append("--skip-tokenizer-init")
        if kv_transfer is not None:
            self.command += ["--kv-transfer-config", json.dumps(kv_transfer)]
        self.command += args
        # VLLM_SERVER_DEV_MODE: /reset_prefix_cache
        self.env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **(env or {})}
        self.start()

    def start(self) -> None:
        """Start the server (again: the same port, flags and environment; the log is
        appended to)."""
        with open(self.log, "a") as log_file:
            self.process = subprocess.Popen(
                self.command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # its engine process too is killed with the group
            )

    def wait_healthy(self, timeout: float = STARTUP_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"vllm serve exited ({self.process.returncode}):\n{self.log_tail()}"
                )
            try:
                http(self.url + "/health", timeout=5)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"vllm serve did not start:\n{self.log_tail()}") from None
                time.sleep(2)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def metric(self, name: str) -> float:
        return metric(http(self.url + "/metrics").decode(), name)

    def reset_prefix_cache(self, external: bool = False) -> None:
        """Reset vLLM's prefix cache (``external``: the connector's, kvtier's, too)."""
        path = "/reset_prefix_cache" + ("?reset_external=true" if external else "")
        assert json.loads(http(self.url + path, {})).get("success") is not False

    def kill(self) -> None:
        """SIGKILL the server and its engine process (a crash); returns once both are gone."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)
        self._wait_group_gone()

    def _wait_group_gone(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
