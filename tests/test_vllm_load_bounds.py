"""Loads that can complete, and chunks lost to a failed load stored again.

A load holds every chunk it fetches in the CPU pool until it is written into vLLM's
blocks, so a hit longer than the pool holds at once would fail partway on every request:
the scheduler loads at most ``max_load_chunks`` chunks past vLLM's own prefix (learnt
from the workers' lookup replies). A load that fails makes vLLM recompute from its first
failed block: the request then stores those chunks again.

    token   0      8      16     24     32     40 41      (chunk 8, block 4)
            |  c0  |  c1  |  c2  |  c3  |  c4  |.|
    b       |== hit, loaded ==============|  computed
                   ^ c1 gone: load fails from here, vLLM recomputes [8, 41)
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from support.kv import bits
from support.vllm_steps import FakeCachedRequests, FakeNewRequest, FakeSchedulerOutput
from support.worker_rig import random_paged, serving_worker

from kvtier.config import load_config
from kvtier.engine import EngineMetadata
from kvtier.integration.vllm.common import LoadSpec, SaveSpec, StepPlan
from kvtier.integration.vllm.rpc import RankLookup, RpcClient
from kvtier.integration.vllm.scheduler import SchedulerSide
from kvtier.integration.vllm.worker import WorkerSide
from kvtier_kernels import PagedKV

CHUNK = 8
BLOCK = 4
LAYERS = 3
HEADS = 2
HEAD = 8
CHUNK_BYTES = 2 * LAYERS * CHUNK * HEADS * HEAD * 2  # bf16
MODES = ["sync", "layerwise", "async"]


# -- the parts of vLLM's objects the scheduler side reads ------------------------------


@dataclasses.dataclass
class Request:
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int


@dataclasses.dataclass
class ConnectorOutput:
    invalid_block_ids: set[int] = dataclasses.field(default_factory=set)


def new_step(req: Request, blocks: list[int], computed: int, scheduled: int) -> FakeSchedulerOutput:
    return FakeSchedulerOutput(
        scheduled_new_reqs=[FakeNewRequest(req.request_id, (list(blocks),), computed)],
        num_scheduled_tokens={req.request_id: scheduled},
    )


def cached_step(req: Request, computed: int, scheduled: int) -> FakeSchedulerOutput:
    cached = FakeCachedRequests([req.request_id], set(), [None], [computed])
    return FakeSchedulerOutput(
        scheduled_cached_reqs=cached, num_scheduled_tokens={req.request_id: scheduled}
    )


# -- the scheduler side alone ----------------------------------------------------------


def all_held(hashes: list[bytes], load_from: int = 0) -> int:
    return len(hashes)


def scheduler(most: int | None, **overrides) -> SchedulerSide:
    config = load_config({"chunk_size": CHUNK, **overrides}, env={})
    return SchedulerSide(config, all_held, block_size=BLOCK, max_load_chunks=lambda: most)


@pytest.mark.parametrize(
    ("most", "vllm_cached", "matched"),
    [(None, 0, 40), (9, 0, 40), (2, 0, 16), (2, 16, 16), (2, 36, 4), (0, 0, 0), (0, 16, 0)],
)
def test_a_hit_is_loaded_up_to_the_chunks_one_load_can_stage(most, vllm_cached, matched):
    """Counted from the chunk the load starts in: vLLM's own prefix is not loaded."""
    side = scheduler(most)
    request = Request("b", list(range(41)), 41)
    assert side.get_num_new_matched_tokens(request, vllm_cached) == (matched, False)
    if not matched:
        return
    blocks = list(range(100, 111))
    side.update_state_after_alloc(request, blocks, matched)
    (load,) = side.build_plan(new_step(request, blocks, vllm_cached, 41 - vllm_cached)).loads
    assert (load.start, load.end) == (vllm_cached, vllm_cached + matched)
    assert load.first_chunk == vllm_cached // CHUNK
    assert len(load.hashes) == -(-(vllm_cached + matched) // CHUNK) - load.first_chunk


@pytest.mark.parametrize(("vllm_cached", "load_from"), [(0, 0), (16, 2), (20, 2)])
def test_the_lookup_is_told_the_chunk_a_load_would_start_in(vllm_cached, load_from):
    """The workers prefetch from there (at most what a load can take), not from chunk 0."""
    asked = []

    def lookup(hashes: list[bytes], load_from: int = 0) -> int:
        asked.append(load_from)
        return len(hashes)

    config = load_config({"chunk_size": CHUNK}, env={})
    side = SchedulerSide(config, lookup, block_size=BLOCK, max_load_chunks=lambda: 2)
    side.get_num_new_matched_tokens(Request("b", list(range(41)), 41), vllm_cached)
    assert asked == [load_from]


def test_chunks_held_past_the_bound_are_not_stored_again():
    side = scheduler(2)
    request = Request("b", list(range(41)), 41)
    blocks = list(range(100, 111))
    matched, _ = side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, blocks, matched)
    plan = side.build_plan(new_step(request, blocks, matched, 41 - matched))
    assert plan.saves == [], "the lookup found every chunk: none is stored again"


@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize(("failed_block", "first_chunk"), [(2, 1), (3, 1), (4, 2), (9, 4)])
def test_a_failed_load_stores_again_from_its_first_failed_chunk(
    is_async, failed_block, first_chunk
):
    side = scheduler(None, enable_async_loading=is_async)
    request = Request("b", list(range(41)), 41)
    blocks = list(range(100, 111))
    side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, blocks, 40)
    if is_async:
        assert len(side.build_plan(FakeSchedulerOutput()).loads) == 1
    else:
        assert len(side.build_plan(new_step(request, blocks, 40, 1)).loads) == 1
    # a block of another request failing changes nothing
    side.update_connector_output(ConnectorOutput({7, 8}))
    # vLLM recomputes from the first failed block
    side.update_connector_output(ConnectorOutput({blocks[failed_block], blocks[-1]}))
    recompute_from = failed_block * BLOCK
    if is_async:  # the request is scheduled for the first time now
        step = new_step(request, blocks, recompute_from, 41 - recompute_from)
    else:
        step = cached_step(request, recompute_from, 41 - recompute_from)
    (save,) = side.build_plan(step).saves
    assert (save.first_chunk, save.chunks_end) == (first_chunk, 40)
    assert len(save.hashes) == 5 - first_chunk
    assert side.build_plan(cached_step(request, 41, 1)).saves == [], "stored twice"


def test_a_preempted_request_forgets_its_load():
    side = scheduler(None)
    request = Request("b", list(range(41)), 41)
    blocks = list(range(100, 111))
    side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, blocks, 40)
    side.build_plan(new_step(request, blocks, 40, 1))
    side.on_preempted({"b"})
    side.update_connector_output(ConnectorOutput({blocks[3]}))  # now another request's block
    assert side.trackers["b"].saved_upto == 40


# -- the scheduler side and a worker, over the lookup socket ---------------------------


def make_pair(tmp_path, mode: str, **overrides):
    """A worker (CPU kernels, 40 blocks of random bits) serving lookups, and the
    scheduler side asking it as in vLLM (``RankLookup``)."""
    config = load_config(
        {
            "chunk_size": CHUNK,
            "max_local_cpu_size": 0.01,
            "kernel_backend": "torch",
            "use_layerwise": mode == "layerwise",
            "enable_async_loading": mode == "async",
            **overrides,
        },
        env={},
    )
    paged = random_paged(LAYERS, 40, BLOCK, HEADS, HEAD)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    worker, endpoint = serving_worker(tmp_path, config, paged, names)
    client = RpcClient([endpoint], 2.0)
    lookup = RankLookup(client)
    side = SchedulerSide(
        config, lookup, block_size=BLOCK, max_load_chunks=lambda: lookup.max_load_chunks
    )
    return worker, paged, side, client


def run_step(worker: WorkerSide, side: SchedulerSide, step: FakeSchedulerOutput, mode: str):
    """One engine step as vLLM drives both sides; the load errors go back to the
    scheduler side as vLLM hands them over."""
    plan = side.build_plan(step)
    worker.start_load(plan)
    if mode == "layerwise":
        for i in range(LAYERS):
            worker.wait_for_layer_load(f"model.layers.{i}.self_attn.attn")
            worker.save_layer(f"model.layers.{i}.self_attn.attn")
    worker.wait_for_save()
    if mode == "async" and plan.loads:
        deadline = time.monotonic() + 5
        while not worker.get_finished() and time.monotonic() < deadline:
            time.sleep(0.002)
    errors = worker.take_load_errors()
    side.update_connector_output(ConnectorOutput(errors))
    return plan, errors


def load_request(worker, side, request, blocks, mode):
    """Look up, allocate and load ``request``; returns (tokens loaded, load errors)."""
    matched, _ = side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, blocks, matched)
    if mode == "async":
        _, errors = run_step(worker, side, FakeSchedulerOutput(), mode)
    else:
        step = new_step(request, blocks, matched, len(request.all_token_ids) - matched)
        _, errors = run_step(worker, side, step, mode)
    return matched, errors


def tokens_kv(paged: PagedKV, blocks: list[int], num_tokens: int) -> list[torch.Tensor]:
    index = [blocks[p // BLOCK] for p in range(num_tokens)]
    offsets = [p % BLOCK for p in range(num_tokens)]
    return [bits(paged.layer_view(i)[:, index, offsets]) for i in range(LAYERS)]


@pytest.mark.parametrize("mode", MODES)
def test_a_hit_longer_than_the_cpu_pool_loads_what_fits(tmp_path, mode):
    """The pool holds 2 chunks, the disk all 4 of a prompt: a request on that prompt
    loads 2 chunks, all of them, instead of failing partway."""
    disk = {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.1}
    worker, paged, side, client = make_pair(
        tmp_path, mode, max_local_cpu_size=2 * CHUNK_BYTES / 2**30, **disk
    )
    try:
        tokens = list(range(500, 533))
        a, blocks_a = Request("a", tokens, 33), list(range(1, 10))
        side.get_num_new_matched_tokens(a, 0)
        side.update_state_after_alloc(a, blocks_a, 0)
        run_step(worker, side, new_step(a, blocks_a, 0, 16), mode)  # chunked prefill
        worker.engine.flush()
        run_step(worker, side, cached_step(a, 16, 17), mode)
        worker.engine.flush()
        assert (
            worker.engine.lookup_hashes(side.trackers["a"].hashes.upto(tokens, 32, partial=False))
            == 4
        )

        b, blocks_b = Request("b", list(tokens), 33), list(range(20, 29))
        matched, errors = load_request(worker, side, b, blocks_b, mode)
        assert (matched, errors) == (2 * CHUNK, set())
        got, want = tokens_kv(paged, blocks_b, matched), tokens_kv(paged, blocks_a, matched)
        for layer in range(LAYERS):
            assert torch.equal(got[layer], want[layer]), f"layer {layer} differs"
    finally:
        client.close()
        worker.shutdown()


@pytest.mark.parametrize("mode", MODES)
def test_chunks_lost_to_a_failed_load_are_stored_again_as_recomputed(tmp_path, mode):
    """Request b's load fails at chunk 1 (evicted after the lookup); vLLM recomputes b
    from there, and b stores chunks 1.. again from its recomputed blocks, never from the
    blocks the failed load left (nor, in the step of the failure, its chunk 4 computed
    over them). A third request then loads b's prompt, bit for bit."""
    worker, paged, side, client = make_pair(tmp_path, mode)
    try:
        tokens = list(range(500, 541))
        a, blocks_a = Request("a", tokens[:33], 33), list(range(1, 10))
        side.get_num_new_matched_tokens(a, 0)
        side.update_state_after_alloc(a, blocks_a, 0)
        run_step(worker, side, new_step(a, blocks_a, 0, 33), mode)

        b, blocks_b = Request("b", list(tokens), 41), list(range(12, 23))
        matched, _ = side.get_num_new_matched_tokens(b, 0)
        assert matched == 32
        side.update_state_after_alloc(b, blocks_b, matched)
        engine = worker.engine
        engine.storage.remove(
            engine.chunker.key(side.trackers["b"].hashes.upto(tokens, 16, partial=False)[1])
        )
        if mode == "async":
            plan, errors = run_step(worker, side, FakeSchedulerOutput(), mode)
        else:
            plan, errors = run_step(worker, side, new_step(b, blocks_b, 32, 9), mode)
            assert [s.first_chunk for s in plan.saves] == [4]  # refused by the worker
        assert errors == set(blocks_b[2:8])
        hashes = side.trackers["b"].hashes.upto(tokens, 40, partial=False)
        assert engine.lookup_hashes(hashes) == 1

        # vLLM recomputes b from token 8: the same KV as a's there, b's own after 32
        for i in range(LAYERS):
            paged.layer_view(i)[:, blocks_b[2:8]] = paged.layer_view(i)[:, blocks_a[2:8]]
        expected = tokens_kv(paged, blocks_b, 40)
        step = new_step(b, blocks_b, 8, 33) if mode == "async" else cached_step(b, 8, 33)
        plan, errors = run_step(worker, side, step, mode)
        assert errors == set() and [(s.first_chunk, s.chunks_end) for s in plan.saves] == [(1, 40)]
        assert engine.lookup_hashes(hashes) == 5

        c, blocks_c = Request("c", list(tokens), 41), list(range(25, 36))
        matched, errors = load_request(worker, side, c, blocks_c, mode)
        assert (matched, errors) == (40, set())
        got = tokens_kv(paged, blocks_c, 40)
        for layer in range(LAYERS):
            assert torch.equal(got[layer], expected[layer]), f"layer {layer} differs"
    finally:
        client.close()
        worker.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-sched", "async-sched"])
def test_async_scheduling_refuses_the_next_steps_saves_over_a_failed_load(async_scheduling):
    """With async scheduling vLLM plans step N+1 before it learns that step N's load
    failed: N+1 computes b's next prefill part over the same garbage, and its save must be
    refused too; a step planned after the failure was reported (N+2) stores again. With
    synchronous scheduling N+1 already recomputes, and its save is stored."""
    config = load_config(
        {"chunk_size": CHUNK, "max_local_cpu_size": 0.01, "kernel_backend": "torch"}, env={}
    )
    worker = WorkerSide(
        config, EngineMetadata("test-model"), None, async_scheduling=async_scheduling
    )
    paged = PagedKV.empty(
        "vllm_hnd", num_layers=LAYERS, num_blocks=16, block_size=BLOCK, num_heads=HEADS,
        head_size=HEAD, dtype=torch.bfloat16,
    )  # fmt: skip
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    worker.register_kv_caches(dict(zip(names, paged.tensors, strict=True)), "FLASH_ATTN")
    try:
        engine, blocks = worker.engine, list(range(1, 9))
        hashes = engine.chunker.chunk_hashes(torch.arange(4 * CHUNK))
        worker.start_load(StepPlan(saves=[SaveSpec("a", 0, hashes[:1], CHUNK, blocks)]))
        worker.wait_for_save()  # chunk 0 only: b's load of chunks 0 and 1 fails at 1
        load = LoadSpec("b", 0, hashes[:2], 2 * CHUNK, 0, 2 * CHUNK, blocks)
        worker.start_load(StepPlan(loads=[load]))
        worker.wait_for_save()
        assert worker.take_load_errors() == set(blocks[2:4])

        def save_step(first: int) -> int:
            save = SaveSpec("b", first, hashes[first : first + 1], (first + 1) * CHUNK, blocks)
            worker.start_load(StepPlan(saves=[save]))
            worker.wait_for_save()
            return engine.lookup_hashes(hashes[first : first + 1])

        assert save_step(2) == (0 if async_scheduling else 1), "step N+1's save"
        assert save_step(3) == 1, "step N+2's save"
    finally:
        worker.shutdown()
