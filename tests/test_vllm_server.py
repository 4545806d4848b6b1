"""kvtier behind vLLM's OpenAI-compatible server, configured with --kv-transfer-config.

The server is started as operators start it (``python -m
vllm.entrypoints.openai.api_server``); a prompt is served, vLLM's own prefix cache is
reset through the dev endpoint, and the same prompt must be served from kvtier: same
completion, and vLLM's ``vllm:external_prefix_cache_hits`` counter goes up.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import BLOCK, CHUNK
from support.engines import expected_loaded, kv_transfer_config, prompts_of

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, payload: dict | None = None, timeout: float = 120) -> bytes:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def _metric(text: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (all label sets)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def server(model_a, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    transfer = kv_transfer_config({"chunk_size": CHUNK}, engine_id="kvtier-test-server")
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_a),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--block-size",
        str(BLOCK),
        "--max-model-len",
        "2048",
        "--kv-cache-memory-bytes",
        str(128 << 20),
        "--enforce-eager",
        "--kv-transfer-config",
        json.dumps(transfer),
    ]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    with open(log, "w") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
            try:
                _http(base + "/health", timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the server did not start:\n{log.read_text()[-4000:]}")
                time.sleep(2)
        yield base, str(model_a)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _complete(base: str, model: str, prompt: list[int]) -> list[int]:
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    body = json.loads(_http(base + "/v1/completions", payload))
    return body["choices"][0]["token_ids"]


def test_openai_server_serves_from_kvtier(server, reference_a, prompts_a):
    base, model = server
    prompt = prompts_a[3]  # 300 tokens
    cold = _complete(base, model, prompt)
    hits_before = _metric(
        _http(base + "/metrics").decode(), "vllm:external_prefix_cache_hits_total"
    )
    assert json.loads(_http(base + "/reset_prefix_cache", {}))["success"] is not False
    warm = _complete(base, model, prompt)
    hits_after = _metric(_http(base + "/metrics").decode(), "vllm:external_prefix_cache_hits_total")
    assert cold == list(reference_a["single"][3].token_ids)
    assert warm == cold
    assert hits_after - hits_before == expected_loaded(
        len(prompt), chunk_size=CHUNK, block_size=BLOCK
    )


def test_openai_server_ragged_prompt_without_hit(server):
    base, model = server
    (prompt,) = prompts_of([50], seed=9)
    assert len(_complete(base, model, prompt)) == 8
