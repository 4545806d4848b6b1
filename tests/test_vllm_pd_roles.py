"""Prefill/decode roles without an engine: what a ``kv_producer`` stores is exactly what a
``kv_consumer`` loads (partial last chunks included, on token-major and whole-block
layouts), a consumer's bounded wait for a producer (``pd_wait_ms``), and a producer's
step that ends only once its stores are complete (``producer_store_timeout_ms``)."""

from __future__ import annotations

import time

import pytest
import torch
from test_vllm_scheduler_side import (
    BLOCK,
    CHUNK,
    HeldHashes,
    blocks_for,
    hit_and_plan,
    make_config,
    make_request,
)
from test_vllm_worker_side import CHUNK as WORKER_CHUNK
from test_vllm_worker_side import chunk_hashes, layer_names, make_cache, save_prompt

from kvtier.config import load_config
from kvtier.integration.vllm.scheduler import SchedulerSide
from kvtier.integration.vllm.worker import EngineMetadata, WorkerSide
from kvtier.storage.disk import FileTier


def pd_side(held: HeldHashes, role: str, *, whole_blocks: bool, **overrides) -> SchedulerSide:
    return SchedulerSide(
        make_config(**overrides),
        held,
        can_load=role != "kv_producer",
        can_save=role != "kv_consumer",
        block_size=BLOCK,
        whole_blocks=whole_blocks,
        partial_chunks=True,
    )


def consumer_load(num_tokens: int, whole_blocks: bool) -> int:
    """What a consumer must load of a prompt a producer stored whole: all but the last
    token (whole blocks only: up to the last whole block before the last token)."""
    end = num_tokens - 1
    return end // BLOCK * BLOCK if whole_blocks else end


# shorter than a chunk, one chunk, exact multiples, ragged, ragged on a block boundary
@pytest.mark.parametrize("num_tokens", [5, 40, 64, 128, 200, 203, 208])
@pytest.mark.parametrize("whole_blocks", [False, True])
def test_consumer_loads_what_the_producer_stored(num_tokens, whole_blocks):
    held = HeldHashes()
    producer = pd_side(held, "kv_producer", whole_blocks=whole_blocks)
    request = make_request("p", num_tokens)
    matched, plan = hit_and_plan(producer, request, 0, blocks_for(num_tokens))
    assert matched == 0 and held.calls == 0, "a kv_producer looked up or loaded"
    for save in plan.saves:
        held.hold(save.hashes)

    consumer = pd_side(held, "kv_consumer", whole_blocks=whole_blocks)
    request = make_request("c", num_tokens)  # same tokens (same seed)
    matched, plan = hit_and_plan(consumer, request, 0, blocks_for(num_tokens, first=300))
    expected = consumer_load(num_tokens, whole_blocks)
    assert matched == expected, (
        f"{num_tokens}-token prompt, whole_blocks={whole_blocks}: the consumer loads "
        f"{matched} tokens, expected {expected} (all but what it must compute)"
    )
    assert plan.saves == [], f"a kv_consumer planned saves: {plan.saves}"
    if expected:
        (load,) = plan.loads
        assert (load.start, load.end) == (0, expected), f"load covers {load.start}..{load.end}"


def test_consumer_waits_for_the_producer_then_loads():
    held = HeldHashes()
    consumer = pd_side(held, "kv_consumer", whole_blocks=False, pd_wait_ms=60_000)
    request = make_request("c", 200)
    assert consumer.get_num_new_matched_tokens(request, 0) == (None, False), (
        "a consumer with pd_wait_ms did not wait for a prompt nobody stored yet"
    )
    assert consumer.pd_waits == 1
    producer = pd_side(held, "kv_producer", whole_blocks=False)
    _, plan = hit_and_plan(producer, make_request("p", 200), 0, blocks_for(200))
    for save in plan.saves:
        held.hold(save.hashes)
    assert consumer.get_num_new_matched_tokens(request, 0) == (199, False), (
        "the consumer did not load the producer's store once it was there"
    )


def test_the_scheduler_exports_only_the_counters_its_role_counts():
    """A producer never looks up, and only a consumer with ``pd_wait_ms`` can wait: no
    series sits at 0 for want of being counted (docs/observability.md)."""
    lookups = {"lookup_requests", "lookup_tokens", "lookup_hit_tokens"}
    held = HeldHashes()
    producer = pd_side(held, "kv_producer", whole_blocks=False, pd_wait_ms=60_000)
    producer.get_num_new_matched_tokens(make_request("p", 200), 0)
    assert not (lookups | {"pd_waits"}) & set(producer.counters())
    both = pd_side(held, "kv_both", whole_blocks=False, pd_wait_ms=60_000)
    assert set(both.counters()) == lookups
    consumer = pd_side(held, "kv_consumer", whole_blocks=False, pd_wait_ms=60_000)
    assert consumer.get_num_new_matched_tokens(make_request("c", 200), 0) == (None, False)
    assert consumer.counters() == dict.fromkeys(lookups, 0) | {"pd_waits": 1}
    assert set(pd_side(held, "kv_consumer", whole_blocks=False).counters()) == lookups


def test_consumer_wait_runs_out_into_a_partial_hit():
    held = HeldHashes()
    producer = pd_side(held, "kv_producer", whole_blocks=False)
    _, plan = hit_and_plan(producer, make_request("p", 200), 0, blocks_for(200))
    held.hold(plan.saves[0].hashes[:2])  # the producer's store got only 2 chunks out
    consumer = pd_side(held, "kv_consumer", whole_blocks=False, pd_wait_ms=50)
    request = make_request("c", 200)
    assert consumer.get_num_new_matched_tokens(request, 0) == (None, False)
    time.sleep(0.06)
    assert consumer.get_num_new_matched_tokens(request, 0) == (2 * CHUNK, False), (
        "after pd_wait_ms the consumer did not take what is held"
    )
    consumer.request_finished(request)
    assert consumer.get_num_new_matched_tokens(request, 0) == (None, False), (
        "a finished request's wait was not forgotten (a new request with its id waits anew)"
    )


@pytest.mark.parametrize("role", ["kv_both", "kv_producer"])
def test_no_wait_unless_a_consumer_only(role):
    held = HeldHashes()
    side = pd_side(held, role, whole_blocks=False, pd_wait_ms=60_000)
    assert side.get_num_new_matched_tokens(make_request("r", 200), 0) == (0, False)


def test_pd_keys_are_checked():
    for key, value in [("pd_wait_ms", -1), ("kv_load_failure_policy", "retry")]:
        with pytest.raises(ValueError, match=key):
            load_config({key: value}, env={})


# -- the producer's store is complete when its step ends ------------------------------


def slow_disk_writes(monkeypatch, delay: float) -> None:
    write_file = FileTier._write_file

    def slow(self, *args, **kwargs):
        time.sleep(delay)
        return write_file(self, *args, **kwargs)

    monkeypatch.setattr(FileTier, "_write_file", slow)


def producer_worker(tmp_path, wait_stored_s: float) -> WorkerSide:
    config = load_config(
        {
            "chunk_size": WORKER_CHUNK,
            "max_local_cpu_size": 0.01,
            "local_disk": str(tmp_path),
            "max_local_disk_size": 0.1,
            "kernel_backend": "torch",
        },
        env={},
    )
    worker = WorkerSide(config, EngineMetadata("m"), None, wait_stored_s=wait_stored_s)
    paged = make_cache("vllm_hnd", dtype=torch.bfloat16)
    worker.register_kv_caches(dict(zip(layer_names(), paged.tensors, strict=True)), "FLASH_ATTN")
    return worker


@pytest.mark.parametrize(("wait_stored_s", "stored_at_return"), [(30.0, True), (0.0, False)])
def test_producer_step_ends_once_stored(tmp_path, monkeypatch, wait_stored_s, stored_at_return):
    slow_disk_writes(monkeypatch, 0.2)
    worker = producer_worker(tmp_path, wait_stored_s)
    try:
        save_prompt(worker, chunk_hashes(worker))
        pending = sum(tier.pending_writes for tier in worker.engine.storage.lower)
        assert (pending == 0) == stored_at_return, (
            f"wait_stored_s={wait_stored_s}: {pending} writes still pending when the step "
            f"returned (stored at return expected: {stored_at_return})"
        )
        assert worker.stats.snapshot().get("producer_store_timeouts", 0) == 0
    finally:
        worker.shutdown()


def test_producer_store_timeout_is_counted(tmp_path, monkeypatch):
    slow_disk_writes(monkeypatch, 0.5)
    worker = producer_worker(tmp_path, 0.05)
    try:
        save_prompt(worker, chunk_hashes(worker))
        assert worker.stats.snapshot().get("producer_store_timeouts") == 1
    finally:
        worker.shutdown()
