"""kvtier inside a real vLLM engine (CPU build): outputs, hits, stats, resets.

One engine with the connector serves the whole module: a cold pass stores every prompt,
vLLM's own prefix cache is reset, and a warm pass must load the stored chunks from kvtier
and produce exactly the outputs of an engine with no connector.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
from conftest import BLOCK, CHUNK
from redis_server import free_port
from vllm_engines import expected_loaded, generate, make_llm, shutdown, worker_stats

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

LAYERS, KV_HEADS, HEAD = 2, 2, 32
CHUNK_BYTES = 2 * LAYERS * CHUNK * KV_HEADS * HEAD * 4  # K and V planes, float32


@pytest.fixture(scope="module")
def run(model_a, prompts_a, shared_prefix_prompts):
    engine_id = "kvtier-test-connector"
    metrics_port = free_port()
    llm = make_llm(
        model_a,
        block_size=BLOCK,
        engine_id=engine_id,
        kvtier={"chunk_size": CHUNK, "max_local_cpu_size": 0.25, "metrics_port": metrics_port},
    )
    try:
        result = {"cold": generate(llm, prompts_a)}
        result["cold_shared"] = generate(llm, shared_prefix_prompts)
        result["stats_cold"] = worker_stats(engine_id)
        assert llm.reset_prefix_cache()
        result["warm"] = generate(llm, prompts_a)
        result["stats_warm"] = worker_stats(engine_id)
        result["metrics"] = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
        assert llm.reset_prefix_cache()
        result["warm_shared"] = generate(llm, shared_prefix_prompts)
        # Resetting with reset_connector=True empties kvtier too: nothing to load after.
        assert llm.reset_prefix_cache(reset_connector=True)
        result["after_clear"] = generate(llm, prompts_a[3:4])
        return result
    finally:
        shutdown(llm)


def test_cold_outputs_equal_no_connector(run, reference_a):
    assert [r.token_ids for r in run["cold"]] == [r.token_ids for r in reference_a["single"]]
    assert [r.token_ids for r in run["cold_shared"]] == [r.token_ids for r in reference_a["shared"]]
    assert all(r.num_cached_tokens == 0 for r in run["cold"])


def test_warm_outputs_equal_no_connector(run, reference_a):
    for i, (got, want) in enumerate(zip(run["warm"], reference_a["single"], strict=True)):
        assert got.token_ids == want.token_ids, f"prompt {i}: warm output differs"
    for got, want in zip(run["warm_shared"], reference_a["shared"], strict=True):
        assert got.token_ids == want.token_ids


def test_warm_pass_loads_every_stored_chunk(run, prompts_a):
    loaded = [r.num_cached_tokens for r in run["warm"]]
    expected = [expected_loaded(len(p), chunk_size=CHUNK, block_size=BLOCK) for p in prompts_a]
    assert loaded == expected
    assert run["warm_shared"][0].num_cached_tokens == 192


def test_worker_counters_match_the_workload(run, prompts_a, shared_prefix_prompts):
    cold, warm = (defaultdict(float, run[k]) for k in ("stats_cold", "stats_warm"))
    # Cold: every full chunk of every prompt, the shared prefix once.
    unique_chunks = sum(len(p) // CHUNK for p in prompts_a) + 3 + 1
    assert cold["stored_chunks"] == unique_chunks
    assert cold["stored_bytes"] == unique_chunks * CHUNK_BYTES
    # Warm: each prompt loads the chunks that cover what it was given.
    chunks_read = sum(
        -(-expected_loaded(len(p), chunk_size=CHUNK, block_size=BLOCK) // CHUNK) for p in prompts_a
    )
    assert warm["loaded_bytes"] - cold["loaded_bytes"] == chunks_read * CHUNK_BYTES
    assert warm["retrieve_hit_tokens"] - cold["retrieve_hit_tokens"] == chunks_read * CHUNK
    assert warm["stored_chunks"] == cold["stored_chunks"]  # nothing stored twice
    assert warm["corrupt_chunks_rejected"] == 0


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_prometheus_endpoint_serves_the_workers_numbers(run, prompts_a):
    metrics, warm = run["metrics"], run["stats_warm"]
    rank0 = (("rank", "0"),)
    for counter in ("stored_chunks", "stored_bytes", "loaded_bytes", "retrieve_hit_tokens"):
        assert metrics[(f"kvtier_{counter}_total", rank0)] == warm[counter], counter
    assert metrics[("kvtier_corrupt_chunks_rejected_total", rank0)] == 0
    scheduler = (("rank", "scheduler"),)
    assert metrics[("kvtier_lookup_tokens_total", scheduler)] >= 2 * sum(map(len, prompts_a))
    assert metrics[("kvtier_lookup_hit_tokens_total", scheduler)] > 0
    assert metrics[("kvtier_load_latency_seconds_count", rank0)] == warm["retrieve_requests"]


def test_reset_connector_empties_kvtier(run, reference_a):
    (after,) = run["after_clear"]
    assert after.num_cached_tokens == 0
    assert after.token_ids == reference_a["single"][3].token_ids
