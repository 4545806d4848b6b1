"""Real ``vllm serve`` OpenAI servers (CPU build) for tests, started as operators start
them (``python -m vllm.entrypoints.openai.api_server``), plus small HTTP helpers.

    server = VllmServer(model, log, kv_transfer=transfer_config, tokenizer=False)
    server.wait_healthy()
    body = post_json(server.url + "/v1/completions", {...})
    server.close()
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
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
    """

    def __init__(
        self,
        model: Path,
        log: Path,
        *,
        kv_transfer: dict | None = None,
        tokenizer: bool = False,
        block_size: int = 32,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [
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
            str(128 << 20),
            "--enforce-eager",
        ]
        if not tokenizer:
            command.append("--skip-tokenizer-init")
        if kv_transfer is not None:
            command += ["--kv-transfer-config", json.dumps(kv_transfer)]
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache
        with open(log, "w") as log_file:
            self.process = subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, env=env
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

    def reset_prefix_cache(self) -> None:
        assert json.loads(http(self.url + "/reset_prefix_cache", {})).get("success") is not False

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
