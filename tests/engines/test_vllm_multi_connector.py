"""kvtier inside vLLM's ``MultiConnector``, beside ``ExampleConnector`` (a connector vLLM
ships that runs on its CPU build), in one real engine: both store every prompt; loads go
to the first connector holding a prefix (kvtier here), and a prompt too short for a kvtier
chunk is loaded by the other. Outputs equal an engine's without any connector.

This is the shape of running disaggregated prefill through one connector (e.g. NIXL on
GPUs) and offloading through kvtier at once (docs/disaggregated.md).
"""

from __future__ import annotations

import uuid

import pytest
from conftest import BLOCK, CHUNK
from support.engines import expected_loaded, generate, make_llm, shutdown, worker_stats

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def multi_connector(engine_id: str, example_path: str) -> dict:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        # NOTE: vLLM reads the load failure policy of the top-level config only
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "KVTierConnector",
                    "kv_connector_module_path": "kvtier.integration.vllm",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"chunk_size": CHUNK},
                },
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": example_path},
                },
            ]
        },
    }


def test_kvtier_beside_another_connector(model_a, prompts_a, reference_a, tmp_path):
    engine_id = f"kvtier-multi-{uuid.uuid4().hex[:8]}"
    example_dir = tmp_path / "example-connector"
    llm = make_llm(
        model_a, block_size=BLOCK, kv_transfer_config=multi_connector(engine_id, str(example_dir))
    )
    try:
        cold = generate(llm, prompts_a)
        assert [r.token_ids for r in cold] == [r.token_ids for r in reference_a["single"]]
        stored = worker_stats(engine_id)["stored_chunks"]
        assert stored == sum(len(p) // CHUNK for p in prompts_a), "kvtier did not store"
        assert any(example_dir.rglob("*.safetensors")), "ExampleConnector did not store"

        assert llm.reset_prefix_cache()
        warm = generate(llm, prompts_a)
        for i, (result, want, prompt) in enumerate(
            zip(warm, reference_a["single"], prompts_a, strict=True)
        ):
            assert result.token_ids == want.token_ids, f"prompt {i}: output differs"
            by_kvtier = expected_loaded(len(prompt), chunk_size=CHUNK, block_size=BLOCK)
            # kvtier is asked first; a prompt shorter than its chunk is the other's
            expected = by_kvtier or (len(prompt) - 1) // BLOCK * BLOCK
            assert result.num_cached_tokens == expected, (
                f"prompt {i} ({len(prompt)} tokens): {result.num_cached_tokens} tokens "
                f"not computed, expected {expected}"
            )
        assert worker_stats(engine_id)["retrieve_hit_tokens"] > 0
    finally:
        shutdown(llm)
