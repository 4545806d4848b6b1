"""kvtier inside a real vLLM engine (CPU build): outputs, hits, stats, resets.

One engine with the connector serves the whole module: a cold pass stores every prompt,
vLLM's own prefix cache is reset, and a warm pass must load the stored chunks from kvtier
and produce exactly the outputs of an engine with no connector.

The engine publishes vLLM's KV events over ZMQ; the module subscribes to them and checks
that kvtier's events come out of vLLM's own stream, keyed by the block hashes of vLLM's
own prefix-cache events.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
from conftest import BLOCK, CHUNK
from support.engines import (
    expected_loaded,
    generate,
    generate_resetting,
    make_llm,
    shutdown,
    worker_stats,
)
from support.event_stream import EventStream
from support.redis_server import free_port
from test_prometheus import scrape_url

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

LAYERS, KV_HEADS, HEAD = 2, 2, 32
CHUNK_BYTES = 2 * LAYERS * CHUNK * KV_HEADS * HEAD * 4  # K and V planes, float32


@pytest.fixture(scope="module")
def run(model_a, prompts_a, shared_prefix_prompts):
    from vllm.config import KVEventsConfig

    engine_id = "kvtier-test-connector"
    metrics_port, events_port = free_port(), free_port()
    stream = EventStream(f"tcp://127.0.0.1:{events_port}")  # before the publisher binds
    llm = None
    try:
        llm = make_llm(
            model_a,
            block_size=BLOCK,
            engine_id=engine_id,
            kvtier={"chunk_size": CHUNK, "max_local_cpu_size": 0.25, "metrics_port": metrics_port},
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{events_port}"
            ),
        )
        result = {"cold": generate(llm, prompts_a)}
        result["cold_shared"] = generate(llm, shared_prefix_prompts)
        result["stats_cold"] = worker_stats(engine_id)
        result["events_cold"] = stream.take()
        assert llm.reset_prefix_cache()
        result["warm"] = generate(llm, prompts_a)
        result["stats_warm"] = worker_stats(engine_id)
        result["metrics"] = scrape_url(f"http://127.0.0.1:{metrics_port}/metrics")
        assert llm.reset_prefix_cache()
        result["warm_shared"] = generate(llm, shared_prefix_prompts)
        result["events_warm"] = stream.take()
        # Resetting with reset_connector=True empties kvtier too: nothing to load after.
        assert llm.reset_prefix_cache(reset_connector=True)
        result["after_clear"] = generate(llm, prompts_a[3:4])
        result["events_after_clear"] = stream.take()
        # Running requests preempted by a reset resume in the next step, loading from kvtier.
        generate(llm, prompts_a)
        assert llm.reset_prefix_cache()
        result["reset_running"] = generate_resetting(llm, prompts_a, after_steps=3)
        return result
    finally:
        if llm is not None:
            shutdown(llm)
        stream.close()


def test_cold_outputs_equal_no_connector(run, reference_a):
    assert [r.token_ids for r in run["cold"]] == [r.token_ids for r in reference_a["single"]]
    assert [r.token_ids for r in run["cold_shared"]] == [r.token_ids for r in reference_a["shared"]]
    assert all(r.num_cached_tokens == 0 for r in run["cold"])


def test_warm_outputs_equal_no_connector(run, reference_a):
    for i, (got, want) in enumerate(zip(run["warm"], reference_a["single"], strict=True)):
        assert got.token_ids == want.token_ids, f"prompt {i}: warm output differs"
    for got, want in zip(run["warm_shared"], reference_a["shared"], strict=True):
        assert got.token_ids == want.token_ids


def test_requests_resumed_after_a_reset_equal_no_connector(run, reference_a):
    """``reset_prefix_cache(reset_running_requests=True)`` mid-decode: each request resumes
    with a load from kvtier, and its output is still that of no connector."""
    assert [r.token_ids for r in run["reset_running"]] == [
        r.token_ids for r in reference_a["single"]
    ]
    assert sum(r.num_cached_tokens for r in run["reset_running"]) > 0, "nothing was loaded"


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


# -- KV events -----------------------------------------------------------------------


def kvtier_events(events: list) -> list:
    return [e for e in events if getattr(e, "ownership", None) == "kvtier"]


def vllm_blocks(events: list) -> dict:
    """vLLM's own prefix-cache events: block hash -> (parent hash, the block's tokens)."""
    from vllm.distributed.kv_events import BlockStored

    blocks = {}
    for e in events:
        if isinstance(e, BlockStored) and e.ownership is None:
            parent = e.parent_block_hash
            for i, h in enumerate(e.block_hashes):
                blocks[h] = (parent, tuple(e.token_ids[i * e.block_size : (i + 1) * e.block_size]))
                parent = h
    return blocks


def test_kv_events_announce_every_stored_chunk_with_vllms_block_hashes(
    run, prompts_a, shared_prefix_prompts
):
    from vllm.distributed.kv_events import BlockStored

    events = run["events_cold"]
    ours = kvtier_events(events)
    assert ours and all(isinstance(e, BlockStored) for e in ours), "cold pass: stores only"
    # One event per chunk stored (the shared prefix once), with that chunk's tokens.
    want = {
        tuple(p[: (k + 1) * CHUNK])
        for p in [*prompts_a, *shared_prefix_prompts]
        for k in range(len(p) // CHUNK)
    }
    assert len(ours) == len(want) == 14
    gpu = vllm_blocks(events)
    prefixes = set()
    for e in ours:
        assert (e.medium, e.locality, e.block_size, e.group_idx) == ("CPU", "LOCAL", BLOCK, 0)
        assert len(e.block_hashes) == CHUNK // BLOCK and len(e.token_ids) == CHUNK
        # Each block is one vLLM's prefix cache announced: same hash, tokens and parent.
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            assert h in gpu, f"block {i} of a kvtier event is not a vLLM block hash"
            assert gpu[h] == (parent, tuple(e.token_ids[i * BLOCK : (i + 1) * BLOCK])), i
            parent = h
        # Walk the parents back to the prompt's start: the whole prefix.
        chain, h = [], e.block_hashes[-1]
        while h is not None:
            parent, tokens = gpu[h]
            chain[:0] = tokens
            h = parent
        prefixes.add(tuple(chain))
    assert prefixes == want
    stored = run["metrics"][("kvtier_kv_events_blocks_stored_total", (("rank", "scheduler"),))]
    assert stored == 14 * CHUNK // BLOCK


def test_kv_events_loads_announce_nothing(run):
    assert kvtier_events(run["events_warm"]) == []


def test_kv_events_reset_connector_withdraws_everything(run, prompts_a):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    announced = {h for e in kvtier_events(run["events_cold"]) for h in e.block_hashes}
    removed, *restored = kvtier_events(run["events_after_clear"])
    assert isinstance(removed, BlockRemoved)
    assert (removed.medium, removed.locality) == ("CPU", "LOCAL")
    assert sorted(removed.block_hashes) == sorted(announced)
    # Then the one prompt served after the reset is stored, and announced, again.
    prompt = prompts_a[3]
    assert [type(e) for e in restored] == [BlockStored] * (len(prompt) // CHUNK)
    assert [e.token_ids for e in restored] == [
        prompt[k * CHUNK : (k + 1) * CHUNK] for k in range(len(prompt) // CHUNK)
    ]
    assert {h for e in restored for h in e.block_hashes} <= announced
