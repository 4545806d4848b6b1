"""Persistent tiers behind a real vLLM engine (CPU build): what one engine stored is
loaded by a new engine process — from the local disk after a restart, and from a shared
Redis by an engine that never saw the prompts — with outputs identical to an engine with
no connector."""

from __future__ import annotations

import pytest
from conftest import BLOCK, CHUNK
from support.engines import (
    expected_loaded,
    generate,
    make_llm,
    shutdown,
    worker_stats_once_written,
)
from support.redis_server import REDIS_MISSING, RedisServer, redis_available

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def run_engine(model, extra: dict, prompts, engine_id: str, written: tuple[str, int] = ("", 0)):
    """Start an engine with kvtier ``extra``, generate, read its counters once ``written``
    (a ``<tier>_put_chunks`` counter and its expected count) is reached, shut it down
    (which flushes kvtier's queued writes)."""
    llm = make_llm(model, block_size=BLOCK, engine_id=engine_id, kvtier=extra)
    try:
        results = generate(llm, prompts)
        return results, worker_stats_once_written(engine_id, *written)
    finally:
        shutdown(llm)


def assert_loaded_everything(results, prompts, reference):
    for i, (got, want, prompt) in enumerate(zip(results, reference, prompts, strict=True)):
        assert got.token_ids == want.token_ids, f"prompt {i}: output differs from no connector"
        loaded = expected_loaded(len(prompt), chunk_size=CHUNK, block_size=BLOCK)
        assert got.num_cached_tokens == loaded, f"prompt {i}"


def test_restarted_engine_loads_from_local_disk(model_a, prompts_a, reference_a, tmp_path):
    extra = {"chunk_size": CHUNK, "max_local_cpu_size": 0.25, "local_disk": str(tmp_path)}
    stored = sum(len(p) // CHUNK for p in prompts_a)
    cold, cold_stats = run_engine(
        model_a, extra, prompts_a, "kvtier-test-disk-1", ("disk_put_chunks", stored)
    )
    assert all(r.num_cached_tokens == 0 for r in cold)
    assert cold_stats["disk_put_chunks"] == stored
    assert len(list(tmp_path.rglob("*.kvt"))) == stored

    warm, warm_stats = run_engine(model_a, extra, prompts_a, "kvtier-test-disk-2")
    assert_loaded_everything(warm, prompts_a, reference_a["single"])
    assert warm_stats["disk_get_hits"] > 0
    assert warm_stats.get("disk_put_chunks", 0) == 0  # nothing written twice
    assert warm_stats.get("corrupt_chunks_rejected", 0) == 0


@pytest.mark.redis
@pytest.mark.skipif(not redis_available(), reason=REDIS_MISSING)
def test_second_engine_loads_from_shared_redis(model_a, prompts_a, reference_a):
    with RedisServer() as redis:
        # The second engine starts with an empty CPU tier: what it loads comes from Redis.
        extra = {"chunk_size": CHUNK, "max_local_cpu_size": 0.25, "remote_url": redis.url}
        stored = sum(len(p) // CHUNK for p in prompts_a)
        cold, cold_stats = run_engine(
            model_a, extra, prompts_a, "kvtier-test-redis-1", ("redis_put_chunks", stored)
        )
        assert [r.token_ids for r in cold] == [r.token_ids for r in reference_a["single"]]
        assert cold_stats["redis_put_chunks"] == stored
        assert len(redis.client().keys("kvtier:*")) == stored

        warm, warm_stats = run_engine(model_a, extra, prompts_a, "kvtier-test-redis-2")
        assert_loaded_everything(warm, prompts_a, reference_a["single"])
        assert warm_stats["redis_get_hits"] > 0
        assert warm_stats.get("redis_put_chunks", 0) == 0
