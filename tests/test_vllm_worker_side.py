"""The vLLM connector's worker side on the CPU: plans in, bit-exact KV out.

A ``WorkerSide`` gets vLLM-shaped KV tensors (``PagedKV.empty`` of the vLLM layouts,
filled with random bits), executes ``StepPlan``s the way vLLM's forward pass drives it,
and serves lookups over a real ipc socket. Stored chunks are read back into *other*
blocks of the same (zeroed) cache and compared bit for bit through the canonical views.

    save   blocks SRC = [9, 2, 14, 5, 11, 0]   tokens 0..23   -> chunks c0 c1 c2 (8 tokens)
    load   blocks DST = [3, 12, 7, 1, 15, 6]   tokens [start, end) of c0 c1 c2
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import torch
from support.kv import bits, fill_random_
from support.vllm_steps import FakeNewRequest, FakeSchedulerOutput

import kvtier.machine
from kvtier.config import load_config
from kvtier.engine import EngineMetadata
from kvtier.integration.vllm.common import LoadSpec, SaveSpec, StepPlan, slot_mapping
from kvtier.integration.vllm.rpc import RpcClient, endpoint_for
from kvtier.integration.vllm.scheduler import SchedulerSide
from kvtier.integration.vllm.worker import WorkerSide
from kvtier.observability.stats import Counter
from kvtier_kernels import PagedKV

NUM_LAYERS = 3
NUM_BLOCKS = 16
BLOCK = 4
HEADS = 2
HEAD = 8
CHUNK = 8
SRC = [9, 2, 14, 5, 11, 0]
DST = [3, 12, 7, 1, 15, 6]
NUM_TOKENS = len(SRC) * BLOCK  # 24: three chunks

LAYOUT_BACKENDS = [("vllm_nhd", "FLASH_ATTN"), ("vllm_hnd", "FLASH_ATTN"), ("vllm_cpu", "CPU_ATTN")]
TOKEN_MAJOR = [lb for lb in LAYOUT_BACKENDS if lb[0] != "vllm_cpu"]
MODES = ["sync", "layerwise", "async"]


def layer_names(num_layers: int = NUM_LAYERS) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


def make_cache(
    layout: str,
    *,
    dtype=torch.bfloat16,
    head_size: int = HEAD,
    block_size: int = BLOCK,
    num_layers: int = NUM_LAYERS,
    num_heads: int = HEADS,
    seed: int = 0,
) -> PagedKV:
    paged = PagedKV.empty(
        layout,
        num_layers=num_layers,
        num_blocks=NUM_BLOCKS,
        block_size=block_size,
        num_heads=num_heads,
        head_size=head_size,
        dtype=dtype,
    )
    gen = torch.Generator().manual_seed(seed)
    for tensor in paged.tensors:
        fill_random_(tensor, gen)
    return paged


@pytest.fixture
def make_worker() -> Iterator:
    """Builds registered workers over fresh random caches; shuts them all down after."""
    made: list[WorkerSide] = []

    def build(
        layout: str = "vllm_hnd",
        backend: str = "FLASH_ATTN",
        *,
        endpoint: str | None = None,
        dtype=torch.bfloat16,
        head_size: int = HEAD,
        block_size: int = BLOCK,
        num_layers: int = NUM_LAYERS,
        num_heads: int = HEADS,
        record_events: bool = False,
        **overrides,
    ) -> tuple[WorkerSide, PagedKV]:
        config = load_config(
            {
                "chunk_size": CHUNK,
                "max_local_cpu_size": 0.01,
                "kernel_backend": "torch",
                **overrides,
            },
            env={},
        )
        shape = {"head_size": head_size, "block_size": block_size, "num_heads": num_heads}
        paged = make_cache(layout, dtype=dtype, num_layers=num_layers, **shape)
        worker = WorkerSide(
            config, EngineMetadata("test-model"), endpoint, record_events=record_events
        )
        made.append(worker)
        names = layer_names(num_layers)
        worker.register_kv_caches(dict(zip(names, paged.tensors, strict=True)), backend)
        return worker, paged

    yield build
    for worker in made:
        worker.shutdown()


def chunk_hashes(worker: WorkerSide, num_tokens: int = NUM_TOKENS, seed: int = 0) -> list[bytes]:
    tokens = torch.arange(seed * 1000, seed * 1000 + num_tokens)
    return worker.engine.chunker.chunk_hashes(tokens)


def blocks_kv(paged: PagedKV, blocks: list[int]) -> list[torch.Tensor]:
    """Per layer, a copy of ``[KV, len(blocks), BS, H, D]`` at ``blocks``."""
    return [paged.layer_view(layer)[:, blocks].clone() for layer in range(paged.num_layers)]


def zero_cache(paged: PagedKV) -> None:
    for tensor in paged.tensors:
        tensor.zero_()


def assert_blocks_hold(
    paged: PagedKV, blocks: list[int], expected: list[torch.Tensor], what: str
) -> None:
    """Bit-compare ``blocks`` of every layer with ``expected``; name the first mismatch."""
    for layer in range(paged.num_layers):
        got = paged.layer_view(layer)[:, blocks]
        diff = bits(got) != bits(expected[layer])
        if diff.any():
            plane, j, offset, head, dim = (int(i) for i in diff.nonzero()[0])
            raise AssertionError(
                f"{what}: layer {layer}, {'KV'[plane]} plane, block {blocks[j]} (#{j}), "
                f"offset {offset}, head {head}, dim {dim}: got "
                f"{got[plane, j, offset, head, dim]!r}, expected "
                f"{expected[layer][plane, j, offset, head, dim]!r}; "
                f"{int(diff.sum())} elements differ in this layer"
            )


def assert_blocks_zero(paged: PagedKV, blocks: list[int], what: str) -> None:
    zeros = [torch.zeros_like(t) for t in blocks_kv(paged, blocks)]
    assert_blocks_hold(paged, blocks, zeros, what)


def tokens_kv(paged: PagedKV, blocks: list[int], positions: range) -> list[torch.Tensor]:
    """Per layer, ``[KV, len(positions), H, D]`` of the tokens at ``positions``."""
    block_index = [blocks[p // paged.block_size] for p in positions]
    offsets = [p % paged.block_size for p in positions]
    return [
        paged.layer_view(layer)[:, block_index, offsets].clone()
        for layer in range(paged.num_layers)
    ]


def assert_tokens_equal(
    got: list[torch.Tensor], want: list[torch.Tensor], positions: range, what: str
) -> None:
    for layer, (g, w) in enumerate(zip(got, want, strict=True)):
        diff = bits(g) != bits(w)
        if diff.any():
            plane, t, head, dim = (int(i) for i in diff.nonzero()[0])
            raise AssertionError(
                f"{what}: layer {layer}, {'KV'[plane]} plane, token {positions[t]}, "
                f"head {head}, dim {dim}: got {g[plane, t, head, dim]!r}, "
                f"expected {w[plane, t, head, dim]!r}"
            )


def run_step(
    worker: WorkerSide, plan: StepPlan, *, layerwise: bool = False, report_first: bool = False
) -> set[int]:
    """One engine step as vLLM drives the connector: bind, per layer wait for its load
    and save it after attention, then wait for the saves; returns the load errors
    reported only with ``report_first``: with speculative decoding, vLLM takes the step's
    results (``get_finished``, the load errors) before ``wait_for_save``, which it defers
    until the draft model has run."""
    worker.start_load(plan)
    if layerwise:
        for name in layer_names():
            worker.wait_for_layer_load(name)
            worker.save_layer(name)
    reported = set()
    if report_first:
        worker.get_finished()
        reported = worker.take_load_errors()
    worker.wait_for_save()
    return reported


def wait_finished(worker: WorkerSide, req_id: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if req_id in worker.get_finished():
            return
        time.sleep(0.002)
    raise AssertionError(f"async load of {req_id!r} not reported finished within {timeout}s")


def save_prompt(worker: WorkerSide, hashes: list[bytes], *, layerwise: bool = False) -> None:
    save = SaveSpec("req-a", 0, hashes, len(hashes) * CHUNK, list(SRC))
    run_step(worker, StepPlan(saves=[save]), layerwise=layerwise)


def load(
    worker: WorkerSide,
    mode: str,
    hashes: list[bytes],
    *,
    start: int = 0,
    end: int = NUM_TOKENS,
    req_id: str = "req-b",
) -> None:
    spec = LoadSpec(req_id, 0, hashes, len(hashes) * CHUNK, start, end, list(DST), mode == "async")
    run_step(worker, StepPlan(loads=[spec]), layerwise=mode == "layerwise")
    if mode == "async":
        wait_finished(worker, req_id)


def mode_overrides(mode: str) -> dict:
    return {"use_layerwise": mode == "layerwise", "enable_async_loading": mode == "async"}


# -- round trips ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("layout", "backend"), LAYOUT_BACKENDS)
def test_save_then_load_into_other_blocks_is_bit_exact(make_worker, layout, backend, mode):
    worker, paged = make_worker(layout, backend, **mode_overrides(mode))
    hashes = chunk_hashes(worker)
    expected = blocks_kv(paged, SRC)
    save_prompt(worker, hashes, layerwise=mode == "layerwise")
    assert worker.stats.get(Counter.STORED_CHUNKS) == 3, (
        f"stored {worker.stats.get(Counter.STORED_CHUNKS)} chunks, expected 3"
    )
    zero_cache(paged)
    load(worker, mode, hashes)
    assert_blocks_hold(paged, DST, expected, f"{layout}/{mode} loaded blocks")
    others = [b for b in range(NUM_BLOCKS) if b not in DST]
    assert_blocks_zero(paged, others, f"{layout}/{mode} blocks outside the load")
    assert worker.take_load_errors() == set(), "a complete load reported errors"


def layerwise_round_trip(make_worker, layout, backend, save_hooks, load_hooks) -> None:
    """Save then load with ``save_layer`` / ``wait_for_layer_load`` called for the given
    layers only (in that order, plus a name that is not a KV layer)."""
    worker, paged = make_worker(layout, backend, use_layerwise=True)
    hashes = chunk_hashes(worker)
    expected = blocks_kv(paged, SRC)

    def step(plan: StepPlan, hooked: list[int]) -> None:
        worker.start_load(plan)
        for name in [*(layer_names()[i] for i in hooked), "model.layers.9.mlp"]:
            worker.wait_for_layer_load(name)
            worker.save_layer(name)
        worker.wait_for_save()

    step(StepPlan(saves=[SaveSpec("req-a", 0, hashes, NUM_TOKENS, list(SRC))]), save_hooks)
    zero_cache(paged)
    load = LoadSpec("req-b", 0, hashes, NUM_TOKENS, 0, NUM_TOKENS, list(DST))
    step(StepPlan(loads=[load]), load_hooks)
    errors = worker.take_load_errors()
    assert errors == set(), f"a complete load reported blocks {sorted(errors)}"
    assert_blocks_hold(
        paged, DST, expected, f"{layout}, hooks: save {save_hooks}, load {load_hooks}"
    )


@pytest.mark.parametrize(
    ("save_hooks", "load_hooks"),
    [([], []), ([0], [0]), ([0, 1], [0, 1]), ([0, 1, 2], [0, 1, 2]), ([2], []), ([2, 0, 1], [])],
)
@pytest.mark.parametrize(("layout", "backend"), LAYOUT_BACKENDS)
def test_layerwise_layers_without_hooks_move_at_wait_for_save(
    make_worker, layout, backend, save_hooks, load_hooks
):
    layerwise_round_trip(make_worker, layout, backend, save_hooks, load_hooks)


@pytest.mark.parametrize(("layout", "backend"), LAYOUT_BACKENDS)
def test_layerwise_saves_copy_each_layer_at_its_hook_when_loads_start_late(
    make_worker, layout, backend
):
    """On a step with no sync load vLLM binds the plan, runs the forward pass, then calls
    ``start_load``: each layer is still copied out at its hook (what changes after it,
    zeroed here, is not what is stored)."""
    worker, paged = make_worker(layout, backend, use_layerwise=True)
    hashes = chunk_hashes(worker)
    expected = blocks_kv(paged, SRC)
    plan = StepPlan(saves=[SaveSpec("req-a", 0, hashes, NUM_TOKENS, list(SRC))])
    worker.bind(plan)
    for name in layer_names():
        worker.wait_for_layer_load(name)
        worker.save_layer(name)
    zero_cache(paged)
    worker.start_load(plan)
    worker.wait_for_save()
    load(worker, "sync", hashes)
    assert_blocks_hold(paged, DST, expected, f"{layout}: layers saved at their hooks")


@pytest.mark.parametrize("load_hooks", [[2], [1, 2], [2, 0, 1]], ids=["last", "skip-0", "2-0-1"])
def test_layerwise_load_when_the_last_layer_is_waited_for_early(make_worker, load_hooks):
    layerwise_round_trip(make_worker, "vllm_hnd", "FLASH_ATTN", [0, 1, 2], load_hooks)


@pytest.mark.parametrize(
    ("dtype", "head_size"), [(torch.float32, 8), (torch.float16, 80), (torch.bfloat16, 1)]
)
@pytest.mark.parametrize(("layout", "backend"), LAYOUT_BACKENDS)
def test_round_trip_dtypes_and_head_sizes(make_worker, layout, backend, dtype, head_size):
    worker, paged = make_worker(layout, backend, dtype=dtype, head_size=head_size)
    hashes = chunk_hashes(worker)
    expected = blocks_kv(paged, SRC)
    save_prompt(worker, hashes)
    zero_cache(paged)
    load(worker, "sync", hashes)
    assert_blocks_hold(paged, DST, expected, f"{layout} {dtype} head_size {head_size}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("start", "end"), [(4, 24), (0, 23), (5, 19), (8, 16)])
@pytest.mark.parametrize(("layout", "backend"), TOKEN_MAJOR)
def test_load_writes_only_start_to_end(make_worker, layout, backend, start, end, mode):
    worker, paged = make_worker(layout, backend, **mode_overrides(mode))
    hashes = chunk_hashes(worker)
    everything = range(NUM_TOKENS)
    expected = tokens_kv(paged, SRC, everything)
    save_prompt(worker, hashes)
    zero_cache(paged)
    first, last = start // CHUNK, -(-end // CHUNK)
    spec = LoadSpec(
        "req-b", first, hashes[first:last], last * CHUNK, start, end, list(DST), mode == "async"
    )
    run_step(worker, StepPlan(loads=[spec]), layerwise=mode == "layerwise")
    if mode == "async":
        wait_finished(worker, "req-b")
    got = tokens_kv(paged, DST, everything)
    inside = range(start, end)
    assert_tokens_equal(
        [g[:, start:end] for g in got],
        [e[:, start:end] for e in expected],
        inside,
        f"tokens [{start}, {end}) loaded",
    )
    outside = [p for p in everything if not start <= p < end]
    zeros = [torch.zeros_like(g[:, outside]) for g in got]
    assert_tokens_equal(
        [g[:, outside] for g in got], zeros, outside, f"tokens outside [{start}, {end})"
    )
    assert worker.take_load_errors() == set(), "a complete load reported errors"


# -- load errors ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_chunks", [3, 2])
@pytest.mark.parametrize(("layout", "backend"), LAYOUT_BACKENDS)
def test_missing_chunk_loads_the_prefix_and_reports_the_rest(
    make_worker, layout, backend, num_chunks, mode
):
    """Chunk 1 is gone: chunk 0 is written, the blocks of ``[8, end)`` are reported and
    left alone; blocks past ``end`` (the request holds all of DST) are not reported."""
    worker, paged = make_worker(layout, backend, **mode_overrides(mode))
    hashes = chunk_hashes(worker)
    expected = blocks_kv(paged, SRC)
    save_prompt(worker, hashes)
    assert worker.engine.storage.remove(worker.engine.chunker.key(hashes[1]))
    zero_cache(paged)
    load(worker, mode, hashes[:num_chunks], end=num_chunks * CHUNK)
    assert_blocks_hold(paged, DST[:2], [e[:, :2] for e in expected], "chunk 0")
    assert_blocks_zero(paged, DST[2:], "blocks of the missing chunk and after it")
    errors = worker.take_load_errors()
    failed = DST[2 : 2 * num_chunks]
    assert errors == set(failed), (
        f"{layout}/{mode}, {num_chunks} chunks asked: reported blocks {sorted(errors)}, "
        f"expected {sorted(failed)} (the blocks of chunks 1 .. {num_chunks - 1})"
    )
    assert worker.take_load_errors() == set(), "load errors were reported twice"


@pytest.mark.parametrize("mode", MODES)
def test_loads_count_the_tokens_asked_for_and_those_loaded(make_worker, mode):
    """Chunk 1 of three is gone: the load asked for 24 tokens and loaded 8, so the hit
    ratio says a third (vLLM's loads never counted what they asked for)."""
    worker, _ = make_worker(**mode_overrides(mode))
    hashes = chunk_hashes(worker)
    save_prompt(worker, hashes)
    assert worker.engine.storage.remove(worker.engine.chunker.key(hashes[1]))
    load(worker, mode, hashes)
    snapshot = worker.stats.snapshot()
    assert snapshot.get(Counter.REQUESTED_TOKENS) == NUM_TOKENS
    assert snapshot.get(Counter.HIT_TOKENS) == CHUNK
    assert snapshot.get("retrieve_hit_ratio") == pytest.approx(1 / 3)


@pytest.mark.parametrize("report_first", [False, True], ids=["saves-first", "errors-first"])
@pytest.mark.parametrize("mode", ["sync", "layerwise"])
def test_kv_computed_over_a_failed_load_is_not_stored(make_worker, mode, report_first):
    """Found by the soak (perf/soak/soak.py): a load fails (chunk 1 gone), and in the same step
    vLLM computes the rest of that request, and of a request sharing the failed blocks
    through its prefix cache, over those blocks' garbage before it learns of the
    failure. Those saves must be dropped (vLLM recomputes them); a request that does not
    touch the failed blocks still stores."""
    worker, _ = make_worker(**mode_overrides(mode))
    hashes = chunk_hashes(worker)
    save_prompt(worker, hashes[:1])  # chunk 0 only: chunk 1 of the load is missing
    failed = DST[2:4]
    sharing = [*DST[:4], 8, 10]  # another request on the same prefix blocks
    other, shared = chunk_hashes(worker, seed=1), chunk_hashes(worker, seed=2)
    plan = StepPlan(
        loads=[LoadSpec("req-b", 0, hashes[:2], 2 * CHUNK, 0, 2 * CHUNK, list(DST))],
        saves=[
            SaveSpec("req-b", 2, hashes[2:], NUM_TOKENS, list(DST)),
            SaveSpec("req-d", 2, shared[2:], NUM_TOKENS, sharing),
            SaveSpec("req-c", 0, other, NUM_TOKENS, list(SRC)),
        ],
    )
    reported = run_step(worker, plan, layerwise=mode == "layerwise", report_first=report_first)
    assert reported | worker.take_load_errors() == set(failed)
    engine = worker.engine
    assert engine.lookup_hashes(hashes[2:]) == 0, "req-b's chunk after the failed load was stored"
    assert engine.lookup_hashes(shared[2:]) == 0, "req-d's chunk over the shared blocks was stored"
    assert engine.lookup_hashes(other) == 3, "an unaffected request's chunks were not stored"
    assert engine.stats.snapshot()["store_skipped_load_failed_chunks"] == 2


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("corrupt", [0, 1, 2])
@pytest.mark.parametrize(("layout", "backend"), LAYOUT_BACKENDS)
def test_corrupt_chunk_is_rejected(make_worker, layout, backend, corrupt, mode):
    # the fault is a byte changed in kvtier's own memory: checked in paranoid mode only
    worker, paged = make_worker(layout, backend, verify_checksums=True, **mode_overrides(mode))
    hashes = chunk_hashes(worker)
    expected = blocks_kv(paged, SRC)
    save_prompt(worker, hashes)
    key = worker.engine.chunker.key(hashes[corrupt])
    obj = worker.engine.storage.cpu.get(key)
    assert obj is not None, f"chunk {corrupt} was not stored"
    try:
        raw = obj.tensor.reshape(-1).view(torch.uint8)
        raw[:16] ^= 0xFF
    finally:
        obj.ref_down()
    zero_cache(paged)
    load(worker, mode, hashes)
    good = 2 * corrupt  # blocks of the chunks before the corrupt one
    assert_blocks_hold(paged, DST[:good], [e[:, :good] for e in expected], "chunks before it")
    assert_blocks_zero(paged, DST[good:], f"blocks of corrupt chunk {corrupt} and after it")
    errors = worker.take_load_errors()
    assert errors == set(DST[good:]), (
        f"{layout}/{mode}, chunk {corrupt} corrupt: reported {sorted(errors)}, "
        f"expected {sorted(DST[good:])}"
    )
    snapshot = worker.stats.snapshot()
    assert snapshot.get("corrupt_chunks_rejected") == 1, (
        f"corrupt_chunks_rejected = {snapshot.get('corrupt_chunks_rejected')}, expected 1"
    )
    assert not worker.engine.storage.contains(key), "the corrupt chunk is still stored"


@pytest.mark.parametrize(("layout", "backend"), LAYOUT_BACKENDS)
def test_a_step_saves_while_an_async_load_is_in_flight(make_worker, monkeypatch, layout, backend):
    """An async load runs beside the engine thread's steps: held at its fetch, it does not
    hold back the next step's save (each direction on its own stream on a GPU); released,
    it loads bit for bit."""
    worker, paged = make_worker(layout, backend, enable_async_loading=True)
    hashes = chunk_hashes(worker)
    expected = blocks_kv(paged, SRC)
    save_prompt(worker, hashes)
    for layer in range(paged.num_layers):
        paged.layer_view(layer)[:, DST] = 0
    fetching, release = threading.Event(), threading.Event()
    begin_retrieve = worker.engine.begin_retrieve

    def held_fetch(*args, **kwargs):
        fetching.set()
        assert release.wait(30), "the test never released the load"
        return begin_retrieve(*args, **kwargs)

    monkeypatch.setattr(worker.engine, "begin_retrieve", held_fetch)
    spec = LoadSpec("req-b", 0, hashes, NUM_TOKENS, 0, NUM_TOKENS, list(DST), is_async=True)
    run_step(worker, StepPlan(loads=[spec]))
    assert fetching.wait(5), "the async load did not start"
    other = chunk_hashes(worker, 2 * CHUNK, seed=1)
    save = SaveSpec("req-c", 0, other, 2 * CHUNK, [4, 8, 10, 13])  # blocks of neither
    step = threading.Thread(target=run_step, args=(worker, StepPlan(saves=[save])))
    step.start()
    step.join(10)
    saved_meanwhile = not step.is_alive()
    release.set()
    step.join()
    assert saved_meanwhile, "the step's save waited for the async load to finish"
    assert worker.stats.get(Counter.STORED_CHUNKS) == 5
    wait_finished(worker, "req-b")
    assert_blocks_hold(paged, DST, expected, f"{layout} blocks of the async load")
    assert worker.take_load_errors() == set()


def test_async_load_that_raises_reports_its_blocks(make_worker):
    worker, _ = make_worker(enable_async_loading=True)
    hashes = chunk_hashes(worker)
    save_prompt(worker, hashes)
    # Blocks past the end of the cache: the scatter raises inside the loader thread.
    bad_blocks = [NUM_BLOCKS + i for i in range(6)]
    spec = LoadSpec("req-b", 0, hashes, NUM_TOKENS, 0, NUM_TOKENS, bad_blocks, is_async=True)
    run_step(worker, StepPlan(loads=[spec]))
    wait_finished(worker, "req-b")
    errors = worker.take_load_errors()
    assert errors == set(bad_blocks), (
        f"an async load that raised reported blocks {sorted(errors)} as not loaded, "
        f"expected all of {bad_blocks}: vLLM treats the others as holding valid KV"
    )


def test_cancelled_async_load_only_reports_finished(make_worker):
    worker, paged = make_worker(enable_async_loading=True)
    before = blocks_kv(paged, list(range(NUM_BLOCKS)))
    cancelled = LoadSpec("req-b", 1, [], 8, 8, 8, list(DST), is_async=True)
    run_step(worker, StepPlan(loads=[cancelled]))
    wait_finished(worker, "req-b")
    assert_blocks_hold(paged, list(range(NUM_BLOCKS)), before, "cache after a cancelled load")
    assert worker.take_load_errors() == set(), "a cancelled load reported errors"
    assert worker.get_finished() == set(), "the cancelled load was reported finished twice"


# -- scheduler and worker together ---------------------------------------------------


@dataclasses.dataclass
class _Request:
    """The parts of vLLM's objects ``SchedulerSide`` reads (see test_vllm_scheduler_side)."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int


def _new_step(req_id: str, blocks: list[int], computed: int, scheduled: int) -> FakeSchedulerOutput:
    return FakeSchedulerOutput(
        scheduled_new_reqs=[FakeNewRequest(req_id, (list(blocks),), computed)],
        num_scheduled_tokens={req_id: scheduled},
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("prompt", "token_major_hit", "whole_blocks_hit"),
    [(20, 16, 16), (16, 15, 12)],
    ids=["partial-last-chunk", "whole-sequence-hit"],
)
@pytest.mark.parametrize(("layout", "backend"), LAYOUT_BACKENDS)
def test_scheduler_plans_run_on_the_worker(
    make_worker, tmp_path, layout, backend, prompt, token_major_hit, whole_blocks_hit, mode
):
    """A prompt stored by one request is looked up over RPC, planned and loaded for a
    second request with the same tokens, into its own blocks."""
    endpoint = endpoint_for(f"t-{uuid.uuid4().hex[:8]}", 0, base_dir=str(tmp_path))
    worker, paged = make_worker(layout, backend, endpoint=endpoint, **mode_overrides(mode))
    whole_blocks = layout == "vllm_cpu"
    client = RpcClient([endpoint], 2.0)

    def lookup(hashes: list[bytes], load_from: int = 0) -> int:
        replies = client.call_all("lookup", hashes=hashes)
        return 0 if replies is None else min(r["hits"] for r in replies)

    side = SchedulerSide(worker.config, lookup, block_size=BLOCK, whole_blocks=whole_blocks)
    tokens = list(range(500, 500 + prompt))
    blocks_a, blocks_b = SRC[: -(-prompt // BLOCK)], DST[: -(-prompt // BLOCK)]
    first = _Request("a", list(tokens), prompt)
    second = _Request("b", list(tokens), prompt)
    try:
        assert side.get_num_new_matched_tokens(first, 0) == (0, False)
        side.update_state_after_alloc(first, blocks_a, 0)
        plan = side.build_plan(_new_step("a", blocks_a, 0, prompt))
        run_step(worker, plan, layerwise=mode == "layerwise")
        expected = tokens_kv(paged, blocks_a, range(prompt))

        matched, is_async = side.get_num_new_matched_tokens(second, 0)
        want = whole_blocks_hit if whole_blocks else token_major_hit
        assert (matched, is_async) == (want, mode == "async"), (
            f"second request: hit ({matched}, {is_async}), expected ({want}, {mode == 'async'})"
        )
        side.update_state_after_alloc(second, blocks_b, matched)
        if mode == "async":
            run_step(worker, side.build_plan(FakeSchedulerOutput()))
            wait_finished(worker, "b")
            plan = side.build_plan(_new_step("b", blocks_b, matched, prompt - matched))
            assert plan.loads == [], f"the async load was planned again: {plan.loads}"
        else:
            plan = side.build_plan(_new_step("b", blocks_b, matched, prompt - matched))
            assert len(plan.loads) == 1, f"expected one load, got {plan.loads}"
        run_step(worker, plan, layerwise=mode == "layerwise")
        assert worker.take_load_errors() == set()
        got = tokens_kv(paged, blocks_b, range(matched))
        assert_tokens_equal(
            got, [e[:, :matched] for e in expected], range(matched), "the second request's hit"
        )
        assert worker.stats.get(Counter.STORED_CHUNKS) == prompt // CHUNK, (
            "the second request stored chunks again"
        )
    finally:
        client.close()


# -- the lookup RPC ------------------------------------------------------------------


@pytest.fixture
def served(make_worker, tmp_path):
    """A worker serving lookups, holding the three chunks of one prompt."""
    endpoint = endpoint_for(f"t-{uuid.uuid4().hex[:8]}", 0, base_dir=str(tmp_path))
    worker, _ = make_worker(endpoint=endpoint)
    hashes = chunk_hashes(worker)
    save_prompt(worker, hashes)
    client = RpcClient([endpoint], 2.0)
    yield worker, endpoint, client, hashes
    client.close()


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ([0, 1, 2], 3),
        ([0, 1], 2),
        ([0, 1, 2, "other"], 3),
        ([0, "other", 2], 1),
        (["other", 0, 1], 0),
        ([1, 2], 2),  # counted from the first hash asked, whichever chunk it names
        ([], 0),
    ],
)
def test_lookup_rpc_counts_leading_held_hashes(served, query, expected):
    _, _, client, hashes = served
    other = b"\x01" * len(hashes[0])
    asked = [other if i == "other" else hashes[i] for i in query]
    replies = client.call_all("lookup", hashes=asked)
    assert replies is not None, "lookup call failed"
    assert [r["hits"] for r in replies] == [expected], (
        f"lookup of chunks {query}: {replies}, expected hits {expected}"
    )


def test_lookup_rpc_stats_clear_and_shutdown(served):
    worker, endpoint, client, hashes = served
    (stats,) = client.call_all("stats")
    assert (stats.get(Counter.STORED_CHUNKS), stats.get(Counter.STORE_REQUESTS)) == (3, 1), (
        f"stats over RPC: {stats}"
    )
    assert client.call_all("clear") is not None, "clear call failed"
    assert len(worker.engine.storage.cpu) == 0, "clear left chunks in the CPU tier"
    (reply,) = client.call_all("lookup", hashes=hashes)
    assert reply["hits"] == 0, f"lookup after clear: {reply}"

    worker.shutdown()
    path = endpoint.removeprefix("ipc://")
    assert not os.path.exists(path), f"shutdown left the socket file {path}"
    assert worker.engine is None, "shutdown kept the engine"
    with RpcClient([endpoint], 0.2) as late:
        assert late.call_all("lookup", hashes=hashes) is None, "a shut-down worker answered"
    worker.shutdown()  # idempotent


def test_metrics_rpc_leaves_the_schedulers_lookup_counters_out(served):
    """A rank's Prometheus export carries its own counters; lookups are counted once, by
    the scheduler (``rank="scheduler"``), so no rank exports them stuck at 0."""
    _, _, client, _ = served
    (metrics,) = client.call_all("metrics")
    assert metrics["labels"] == {"rank": "0"}
    assert metrics["counters"][Counter.STORED_CHUNKS] == 3
    lookups = {Counter.LOOKUP_TOKENS, Counter.LOOKUP_HIT_TOKENS} & set(metrics["counters"])
    assert lookups == set(), f"a worker rank exported {sorted(lookups)}"


def test_metrics_rpc_leaves_the_lookup_request_count_to_the_scheduler(served):
    _, _, client, _ = served
    (metrics,) = client.call_all("metrics")
    assert Counter.LOOKUP_REQUESTS not in metrics["counters"]


@pytest.mark.parametrize("record_events", [False, True], ids=["events-off", "events-on"])
def test_metrics_rpc_exports_no_kv_event_counter_a_rank_never_counts(
    make_worker, tmp_path, record_events
):
    """The scheduler announces KV events and counts them; a rank counts only the tier
    records its full log dropped, and only while it records them."""
    endpoint = endpoint_for(f"t-{uuid.uuid4().hex[:8]}", 0, base_dir=str(tmp_path))
    make_worker(endpoint=endpoint, record_events=record_events)
    with RpcClient([endpoint], 2.0) as client:
        (metrics,) = client.call_all("metrics")
    exported = {name for name in metrics["counters"] if name.startswith("kv_events_")}
    assert exported == ({Counter.KV_EVENTS_DROPPED} if record_events else set()), exported


def test_worker_without_endpoint_serves_nothing(make_worker):
    worker, _ = make_worker(endpoint=None)
    assert worker._server is None
    worker.shutdown()
    worker.shutdown()


def test_forced_layout_from_config(make_worker):
    worker, _ = make_worker("vllm_hnd", "MYSTERY_ATTN", kv_layout="vllm_hnd")
    assert worker.engine.paged_io.paged.layout.name == "vllm_hnd"


# -- slot_mapping --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block_ids", "block_size", "num_tokens", "start", "end", "expected"),
    [
        ([3, 7], 4, 8, 0, None, [12, 13, 14, 15, 28, 29, 30, 31]),
        ([3, 7], 4, 8, 2, 6, [-1, -1, 14, 15, 28, 29, -1, -1]),
        ([3], 4, 8, 0, None, [12, 13, 14, 15, -1, -1, -1, -1]),
        ([3, 7], 4, 6, 0, None, [12, 13, 14, 15, 28, 29]),
        ([], 4, 3, 0, None, [-1, -1, -1]),
        ([5, 0, 2], 1, 4, 1, 3, [-1, 0, 2, -1]),
        ([1, 2], 4, 8, 8, 8, [-1] * 8),
        ([1], 4, 0, 0, None, []),
    ],
)
def test_slot_mapping(block_ids, block_size, num_tokens, start, end, expected):
    slots = slot_mapping(block_ids, block_size, num_tokens, start, end)
    assert slots.dtype == torch.int64, f"slots are {slots.dtype}, expected int64"
    got = slots.tolist()
    assert len(got) == len(expected), f"{len(got)} slots, expected {len(expected)}"
    wrong = [(p, g, w) for p, (g, w) in enumerate(zip(got, expected, strict=True)) if g != w]
    assert not wrong, f"blocks {block_ids}, [{start}, {end}): (position, got, expected) {wrong}"


def test_a_pool_that_does_not_fit_beside_vllms_kv_cache_names_both(make_worker, monkeypatch):
    monkeypatch.setattr(kvtier.machine, "host_memory", lambda: (1 << 20, 8 << 30))
    with pytest.raises(
        kvtier.machine.PoolTooLarge,
        match=r"^max_local_cpu_size=0\.01 .*; lower it, or vLLM's KV cache: it already holds "
        r"0\.0 GiB .*--kv-cache-memory-bytes and max_local_cpu_size\)$",
    ):
        make_worker("vllm_cpu", "CPU_ATTN")


@pytest.mark.parametrize(("layout", "backend"), LAYOUT_BACKENDS)
def test_engines_of_other_block_sizes_share_chunks_only_in_token_major_layouts(
    make_worker, layout, backend
):
    """A producer with 32-token blocks and a consumer with 64-token blocks (disaggregated
    prefill): the CPU layout's chunks are whole blocks whose bytes interleave their tokens,
    so the consumer would load another KV than the producer stored; they must miss."""
    keys = {
        block_size: make_worker(layout, backend, block_size=block_size)[
            0
        ].engine.chunker.key_template
        for block_size in (BLOCK, 2 * BLOCK)
    }
    if (layout, backend) in TOKEN_MAJOR:
        assert keys[BLOCK] == keys[2 * BLOCK], f"{layout}: block sizes split the chunks"
    else:
        assert keys[BLOCK] != keys[2 * BLOCK], f"{layout}: block sizes share chunk keys"


@pytest.mark.parametrize(
    "geometry",
    [{"num_layers": 2}, {"head_size": 2 * HEAD}, {"num_heads": 1, "head_size": 2 * HEAD}],
    ids=["layers", "head_size", "heads"],
)
def test_a_model_of_another_geometry_under_the_same_name_misses(tmp_path, make_worker, geometry):
    """Two engines serve "test-model" from one disk, the second with other layers, heads
    or head size (a local path reused for another checkpoint): its lookups miss, rather
    than promise chunks its load would refuse (or, at the same bytes per token, load as
    the wrong KV). A second engine of the first geometry (the decode side of a P/D pair)
    finds every chunk."""
    disk = {"local_disk": str(tmp_path), "max_local_disk_size": 0.1}
    producer = make_worker(**disk)[0]
    hashes = chunk_hashes(producer)
    save_prompt(producer, hashes)
    assert producer.engine.flush(timeout=10)
    consumer, other = make_worker(**disk)[0], make_worker(**disk, **geometry)[0]
    assert chunk_hashes(consumer) == chunk_hashes(other) == hashes
    assert consumer.engine.lookup_hashes(hashes) == len(hashes), "the same model misses"
    assert other.engine.lookup_hashes(hashes) == 0, f"{geometry}: another geometry hits"
    assert consumer.engine.chunker.key(hashes[0]).tags == (("kv_geometry", "3x2x8"),)
