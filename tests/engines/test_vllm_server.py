"""kvtier behind vLLM's OpenAI-compatible server, configured with --kv-transfer-config.

The server is started as operators start it (``python -m
vllm.entrypoints.openai.api_server``); a prompt is served, vLLM's own prefix cache is
reset through the dev endpoint, and the same prompt must be served from kvtier: same
completion, and vLLM's ``vllm:external_prefix_cache_hits`` counter goes up.
"""

from __future__ import annotations

import pytest
from conftest import BLOCK, CHUNK
from support.engines import expected_loaded, kv_transfer_config, prompts_of
from support.vllm_openai import VllmServer, post_json

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def server(model_a, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    transfer = kv_transfer_config({"chunk_size": CHUNK}, engine_id="kvtier-test-server")
    server = VllmServer(model_a, log, kv_transfer=transfer, block_size=BLOCK)
    try:
        server.wait_healthy()
        yield server, str(model_a)
    finally:
        server.close()


def _complete(base: str, model: str, prompt: list[int]) -> list[int]:
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    body = post_json(base + "/v1/completions", payload)
    return body["choices"][0]["token_ids"]


def test_openai_server_serves_from_kvtier(server, reference_a, prompts_a):
    server, model = server
    prompt = prompts_a[3]  # 300 tokens
    cold = _complete(server.url, model, prompt)
    hits_before = server.metric("vllm:external_prefix_cache_hits_total")
    server.reset_prefix_cache()
    warm = _complete(server.url, model, prompt)
    hits_after = server.metric("vllm:external_prefix_cache_hits_total")
    assert cold == list(reference_a["single"][3].token_ids)
    assert warm == cold
    assert hits_after - hits_before == expected_loaded(
        len(prompt), chunk_size=CHUNK, block_size=BLOCK
    )


def test_openai_server_ragged_prompt_without_hit(server):
    server, model = server
    (prompt,) = prompts_of([50], seed=9)
    assert len(_complete(server.url, model, prompt)) == 8
