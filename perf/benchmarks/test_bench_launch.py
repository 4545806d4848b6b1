"""Host cost of a kernel call: microseconds of Python per launch, for every GPU op's launcher.

The kernels run at the copy ceiling on a GPU; what a serving engine also pays is the host
time before each kernel is queued (170-260 us per call in the first H200 run, against
15-19 us kernels). These rows measure that time on the kernel benchmark's shape (32 layers
x 8 KV heads x 128, bf16, a 256-token chunk, ``vllm_nhd`` blocks of 16, a random block
table) against the design budget of 15 us per call.

- CPU rows (run anywhere): the launch path as a GPU runs it (argument checks, the cached
  launch plan's lookup, the per-call work of the plan), with the device launch replaced by
  a recorder (:func:`kvtier_kernels._launch.record_launches`) and the plan built for
  Triton's interpreter (CPU tensors). What a GPU adds and a CPU cannot run: Triton's own
  C launcher and reading the current stream (the GPU rows measure them). The baseline of
  each row, measured in the same run, is the uncached path: the plan rebuilt on every call
  (validation, address table, word type, launch config, grid), which is what every call
  paid before plans were cached (less Triton's argument binding, a GPU-only cost), and
  each row also records an empty Python call for scale. Host slot mappings are
  range-checked on every call (``slot range check`` row); a GPU caller passes slots placed
  on the device once per request (``PagedIO.device_slots``), which skip it.
- GPU rows (marked ``gpu``, skipped without one): the method of
  ``../shared/gpu/profile_launch.py`` with real launches: host time per call (enqueue, no
  sync), wall time per call back to back, and the GPU's kernel time per call from
  ``torch.profiler``; the ratio is wall / kernel (1.0: the host keeps up with the GPU).

Layer-wise (``use_layerwise``): a layer of one chunk is one plan call with ``layers`` of
one layer, the ``paged_io_*_per_layer`` rows; the per-step fence of the side streams
(``PagedIO.storing``) is paid once per step and is a GPU-only row.

The CacheGen coder (``rans_encode`` / ``rans_decode`` rows, ``rans_encode_lanes`` /
``rans_decode_lanes`` through their cached plans, :mod:`kvtier_kernels.cachegen.rans.plans`)
runs on the compression benchmark's lanes, in the streams the codec codes them in
(:func:`~kvtier_kernels.cachegen.format.lanes_per_stream`, up to ``STREAM_SYMBOLS`` = 1024
symbols a stream): a 256-token chunk of 32 layers x 8 heads x 128 is 2 x 32 x 1024 = 65536
lanes of 256 symbols, 4 a stream, 16384 streams of 1024 symbols (``chunk``), and its small
chunk (``small_kv``: 4 layers x 128 channels x 64 tokens, 1024 lanes of 64 symbols, 16 a
stream, 64 streams of 1024 symbols), with the default levels' 33-symbol alphabet. Its
kernels build the call's cumulative tables and check its tables and lengths themselves; a
call allocates its buffers (one of them a zeroed summary), launches, and reads the
summary's counts back once (one host sync: the checks must raise before any symbol is
used, and the encoder sizes its output by them), then an encode allocates its words and
launches the compaction. So two or three rows each: the whole call against the uncached
path, the part queued before the sync (``*_before_sync``: key, plan lookup, buffers,
launch) against the whole call, and for an encode the part after it
(``rans_encode_after_sync``: the words for the stream's real length, the compaction's
launch) against the whole call. Under the recorder no kernel runs and the counts read 0,
so the whole encode row finds no words to compact: the after-sync row times that part.
The rows carry ``tensor_ops_per_call`` (on a GPU each is a few us of host time; on the CPU
a zeroed buffer also costs its memset).

Before the first copy (``host_us_before_first_copy`` rows, CPU): a ``CacheEngine.store`` /
``retrieve`` of the GPU engine benchmark's prompt (four 256-token chunks, token ids as a
tensor), timed from the call to the moment its first chunk's copy is queued
(``PagedIO.from_engine`` / ``to_engine`` entered), launches recorded. The engine hashes the
prompt's chunks as it reaches them (``Chunker.prompt_chunks``); the baseline, in the same
run, is the prompt hashed whole first (``Chunker.chunks`` then ``store_chunks`` /
``retrieve_chunks``), as every store and retrieve did before.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch
from conftest import interleaved_medians, median_seconds
from torch.utils._python_dispatch import TorchDispatchMode

from kvtier.config import load_config
from kvtier.engine import CacheEngine, EngineMetadata
from kvtier.paged_io import PagedIO
from kvtier_kernels import PagedKV, gather, rerotate, scatter
from kvtier_kernels._launch import record_launches
from kvtier_kernels.cachegen import quantize_counts
from kvtier_kernels.cachegen.format import lanes_per_stream
from kvtier_kernels.cachegen.rans import plans as rans_plans
from kvtier_kernels.cachegen.rans import rans_decode_lanes, rans_encode_lanes
from kvtier_kernels.paged.plans import check_slot_range
from kvtier_kernels.paged.rows import launch_cache
from kvtier_kernels.rope.plans import clear_plans

RESULTS_NAME = "launch"
LAYERS, HEADS, HEAD_SIZE, CHUNK = 32, 8, 128, 256
DTYPE = torch.bfloat16
LAYOUT, BLOCK_SIZE, NUM_BLOCKS = "vllm_nhd", 16, 128
BUDGET_US = 15.0
CALLS, ROUNDS = 400, 7
HAS_GPU = torch.cuda.is_available()


def make_case(device: torch.device, pinned: bool = False) -> dict:
    """The benchmark's cache, slots, chunk (on ``device``, or pinned host memory) and K
    plane with positions."""
    paged = PagedKV.empty(
        LAYOUT,
        num_layers=LAYERS,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        num_heads=HEADS,
        head_size=HEAD_SIZE,
        dtype=DTYPE,
        device=device,
    )
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)[: CHUNK // BLOCK_SIZE]
    slots = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten().to(device)
    chunk = torch.zeros(paged.chunk_shape(CHUNK), dtype=DTYPE, pin_memory=pinned)
    chunk = chunk if pinned else chunk.to(device)
    positions = torch.arange(CHUNK, device=device) + 4096
    k = torch.zeros(LAYERS, CHUNK, HEADS * HEAD_SIZE, dtype=DTYPE, device=device)
    return {
        "paged": paged,
        "slots": slots,
        "chunk": chunk,
        "k": k,
        "old": positions,
        "new": positions - 3072,
    }


def per_call_us(fn: Callable[[], object], calls: int = CALLS, rounds: int = ROUNDS) -> float:
    """Median over ``rounds`` of the mean host time of ``calls`` back-to-back calls (us)."""
    for _ in range(min(calls, 50)):
        fn()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - started) / calls)
    return statistics.median(times) * 1e6


def cpu_ops(case: dict, backend: str) -> dict[str, Callable[[], object]]:
    """Each op's call as a serving engine makes it (interpreted plans on the CPU). The
    ``paged_io_*`` calls run inside an open batch, as a transfer's step makes them."""
    paged, slots, chunk = case["paged"], case["slots"], case["chunk"]
    io = case.setdefault("io", PagedIO(paged, backend))
    one_layer = chunk[:, 5:6]
    layer = range(5, 6)
    return {
        "gather": lambda: gather(paged, slots, chunk, backend=backend),
        "scatter": lambda: scatter(paged, slots, chunk, backend=backend),
        "paged_io_from_engine": lambda: io.from_engine(chunk, slots),
        "paged_io_to_engine": lambda: io.to_engine(chunk, slots),
        "paged_io_from_engine_per_layer": lambda: io.from_engine(one_layer, slots, layer),
        "paged_io_to_engine_per_layer": lambda: io.to_engine(one_layer, slots, layer),
        "rerotate": lambda: rerotate(
            case["k"], case["old"], case["new"], head_size=HEAD_SIZE, backend=backend
        ),
    }


def batch_of(op: str, case: dict) -> contextlib.AbstractContextManager[None]:
    """The batch a ``paged_io_*`` call runs in (one per step), else nothing."""
    if not op.startswith("paged_io_"):
        return contextlib.nullcontext()
    io = case["io"]
    return io.storing() if "from_engine" in op else io.loading()


def _uncached(fn: Callable[[], object], case: dict) -> Callable[[], object]:
    """``fn`` with every cached launch plan dropped first: the path before plans."""

    def run() -> object:
        launch_cache(case["paged"]).clear()
        clear_plans()
        return fn()

    return run


OPS = [
    "gather",
    "scatter",
    "paged_io_from_engine",
    "paged_io_to_engine",
    "paged_io_from_engine_per_layer",
    "paged_io_to_engine_per_layer",
    "rerotate",
]


@pytest.mark.parametrize("op", OPS)
def test_host_us_per_call_with_a_recorder_for_the_device(op: str, record) -> None:
    pytest.importorskip("triton")
    case = make_case(torch.device("cpu"))
    fn = cpu_ops(case, "interpret")[op]
    with record_launches() as recorder, batch_of(op, case):
        cached = per_call_us(fn)
        uncached = per_call_us(_uncached(fn, case), calls=40, rounds=3)
        empty = per_call_us(lambda: None)
    assert recorder.calls > 0, "the recorder saw no launch: the row would time nothing"
    record(
        metric="host_us_per_call",
        value=cached,
        unit="us",
        baseline="the same call with no cached plan (rebuilt every call)",
        baseline_value=uncached,
        empty_python_call_us=empty,
        budget_us=BUDGET_US,
        meets_budget=cached <= BUDGET_US,
        device="cpu (launch recorded, not run)",
        note="host slots: includes the per-call slot range check",
    )


def test_slot_range_check_of_host_slots(record) -> None:
    """What a host slot mapping costs per call (a GPU caller checks it once per request)."""
    case = make_case(torch.device("cpu"))
    value = per_call_us(lambda: check_slot_range(case["paged"], case["slots"]))
    empty = per_call_us(lambda: None)
    record(
        metric="host_us_per_call",
        value=value,
        unit="us",
        baseline="an empty Python call",
        baseline_value=empty,
    )


# ---------------------------------------------------------------------------------------
# the CacheGen coder (rANS): the compression benchmark's lanes
# ---------------------------------------------------------------------------------------

RANS_SHAPES = {"chunk": (2 * LAYERS * HEADS * HEAD_SIZE, CHUNK), "small_kv": (2 * 4 * 128, 64)}
"""``(lanes, tokens)``: the codec codes them as ``lanes_per_stream(lanes, tokens)`` a stream."""
RANS_ALPHABET = 2 * 16 + 1  # the default levels' largest levels_half, 16
RANS_ROUNDS = {"chunk": 15, "small_kv": 101}  # rounds of interleaved single calls
_rans_cases: dict[tuple[str, str], dict] = {}


def rans_case(shape: str, device: torch.device) -> dict:
    """Symbols of quantized KV (each lane a rounded normal around the middle of the
    alphabet, its own spread), each lane's table from its histogram, and their streams of
    several lanes as the codec makes them (built once per shape and device)."""
    case = _rans_cases.get((shape, str(device)))
    if case is None:
        lanes, n = RANS_SHAPES[shape]
        rng = np.random.default_rng(1)
        spread = rng.uniform(0.5, 4.0, size=(lanes, 1))
        values = np.rint(rng.normal(RANS_ALPHABET // 2, spread, size=(lanes, n)))
        symbols = torch.from_numpy(np.clip(values, 0, RANS_ALPHABET - 1).astype(np.uint8))
        flat = (torch.arange(lanes)[:, None] * RANS_ALPHABET + symbols).flatten()
        counts = torch.bincount(flat, minlength=lanes * RANS_ALPHABET)
        freq = quantize_counts(counts.view(lanes, RANS_ALPHABET))
        group = lanes_per_stream(lanes, n)
        streams = symbols.view(lanes // group, group * n)
        # the numpy coder: numba's threads would keep spinning into the timed calls
        words, lengths = rans_encode_lanes(streams, freq, "torch", tables_per_stream=group)
        case = {"symbols": streams, "freq": freq, "words": words, "lengths": lengths}
        case |= {"n": group * n, "group": group}
        case = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
        _rans_cases[(shape, str(device))] = case
    return case


def rans_calls(case: dict, backend: str) -> dict[str, Callable[[], object]]:
    """The coder's calls as the codec makes them, and the part of each before its sync."""
    symbols, freq, words, lengths, n, group = (
        case[k] for k in ("symbols", "freq", "words", "lengths", "n", "group")
    )

    def encode_before_sync() -> object:
        plan = rans_plans.cached_plan(rans_plans.encode_key(backend, symbols, freq, group))
        return plan.enqueue(symbols, freq)

    def decode_before_sync() -> object:
        key = rans_plans.decode_key(backend, words, lengths, freq, n, group)
        return rans_plans.cached_plan(key).enqueue(words, lengths, freq)

    def encode_after_sync() -> object:
        plan = rans_plans.cached_plan(rans_plans.encode_key(backend, symbols, freq, group))
        if "encoded" not in case:  # the encoder's buffers, as a call's sync leaves them
            case["encoded"] = plan.enqueue(symbols, freq)
        return plan.compact(*case["encoded"], len(words))

    return {
        "rans_encode": lambda: rans_encode_lanes(symbols, freq, backend, tables_per_stream=group),
        "rans_decode": lambda: rans_decode_lanes(
            words, lengths, freq, n, backend, tables_per_stream=group
        ),
        "rans_encode_before_sync": encode_before_sync,
        "rans_decode_before_sync": decode_before_sync,
        "rans_encode_after_sync": encode_after_sync,
    }


def whole_call(op: str) -> str:
    """The call a ``*_before_sync`` / ``*_after_sync`` row times part of (else ``op``)."""
    return op.removesuffix("_before_sync").removesuffix("_after_sync")


class TensorOps(TorchDispatchMode):
    """Counts the ATen ops run inside it (allocations, fills, reductions, views)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def tensor_ops(fn: Callable[[], object]) -> int:
    with TensorOps() as ops:
        fn()
    return ops.count


RANS_NOTES = {
    "rans_encode_before_sync": "key, plan lookup, scratch and zeroed summary, launch",
    "rans_decode_before_sync": "key, plan lookup, table, output and zeroed summary, launch",
    "rans_encode_after_sync": "the words for the stream's length, the compaction's launch",
    "whole": "buffers, launch, the summary's counts read back (one sync); under the "
    "recorder they read 0, so an encode has no words to compact (its after-sync row)",
}
RANS_OPS = [
    "rans_encode",
    "rans_encode_before_sync",
    "rans_encode_after_sync",
    "rans_decode",
    "rans_decode_before_sync",
]


@pytest.mark.parametrize("shape", list(RANS_SHAPES))
@pytest.mark.parametrize("op", RANS_OPS)
def test_rans_host_us_per_call_with_a_recorder_for_the_device(op: str, shape: str, record) -> None:
    """A whole call against the uncached path, or a part of it (before or after its sync)
    against the whole call. A part alternates with the whole call, so that the load of a
    shared machine weighs on both alike; a whole call and the uncached path are timed
    apart: the uncached path's plan build maps and unmaps tens of MB (a ``chunk``'s 76 MB
    scratch), after which glibc gives the heap's top back, and the next call paid for
    faulting in its zeroed summary again (14-21 us against 10.5 back to back)."""
    pytest.importorskip("triton")
    case = rans_case(shape, torch.device("cpu"))
    calls = rans_calls(case, "interpret")
    fn, whole = calls[op], calls[whole_call(op)]
    part = op != whole_call(op)
    with record_launches() as recorder:
        whole()  # builds the plan
        if part:
            value, baseline_value = interleaved_medians(fn, whole, repeat=RANS_ROUNDS[shape])
        else:
            rounds = RANS_ROUNDS[shape]
            value = median_seconds(fn, repeat=rounds, warmup=2)
            baseline_value = median_seconds(
                whole, repeat=rounds, warmup=2, setup=rans_plans.clear_plans
            )
        ops = tensor_ops(fn)
        empty = per_call_us(lambda: None)
    assert recorder.calls > 0, "the recorder saw no launch: the row would time nothing"
    lanes, n = RANS_SHAPES[shape]
    record(
        metric="host_us_per_call",
        value=value * 1e6,
        unit="us",
        baseline="the whole call (same run)"
        if part
        else "the same call with no cached plan (rebuilt every call)",
        baseline_value=baseline_value * 1e6,
        empty_python_call_us=empty,
        budget_us=BUDGET_US,
        meets_budget=value * 1e6 <= BUDGET_US,
        tensor_ops_per_call=ops,
        host_syncs_per_call=0 if part else 1,
        lanes=lanes,
        symbols_per_lane=n,
        lanes_per_stream=case["group"],
        alphabet=RANS_ALPHABET,
        device="cpu (launch recorded, not run)",
        note=RANS_NOTES.get(op, RANS_NOTES["whole"]),
    )


# ---------------------------------------------------------------------------------------
# GPU: real launches (profile_launch.py's method)
# ---------------------------------------------------------------------------------------


def _gpu_times(fn: Callable[[], object]) -> tuple[float, float, float]:
    """(host enqueue us, wall us back to back, GPU kernel us) per call."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    n = 200
    started = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - started) / n
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - started) / n
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    busy = 0.0
    for event in prof.events():
        if event.device_type.name == "CUDA":
            busy += getattr(event, "device_time_total", 0.0) or event.cuda_time_total
    return host * 1e6, wall * 1e6, busy / 20


GPU_OPS = [
    ("gather", "device"),
    ("gather", "pinned"),
    ("scatter", "device"),
    ("scatter", "pinned"),
    ("paged_io_from_engine", "pinned"),
    ("paged_io_to_engine", "pinned"),
    ("paged_io_from_engine_per_layer", "pinned"),
    ("paged_io_to_engine_per_layer", "pinned"),
    ("rerotate", "device"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize(("op", "chunk_memory"), GPU_OPS)
def test_gpu_host_us_and_wall_vs_kernel(op: str, chunk_memory: str, record) -> None:
    case = make_case(torch.device("cuda"), pinned=chunk_memory == "pinned")
    fn = cpu_ops(case, "triton")[op]
    if op.startswith("paged_io_"):  # the slots a transfer passes: placed once per request
        slots = case["io"].device_slots(case["slots"].cpu())
        fn = cpu_ops({**case, "slots": slots}, "triton")[op]
    with batch_of(op, case):
        host, wall, kernel = _gpu_times(fn)
    record(
        metric="wall_us_per_call",
        value=wall,
        unit="us",
        baseline="GPU kernel time per call (torch.profiler)",
        baseline_value=kernel,
        host_us_per_call=host,
        budget_us=BUDGET_US,
        meets_budget=host <= BUDGET_US,
        chunk_memory=chunk_memory,
        device=torch.cuda.get_device_name(0),
    )


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA/ROCm GPU")
def test_gpu_step_fence_of_the_side_streams(record) -> None:
    """What a step pays once, around its copies: the fence and the event of a batch."""
    case = make_case(torch.device("cuda"), pinned=True)
    io = PagedIO(case["paged"], "triton")

    def empty_batch() -> None:
        with io.storing():
            pass

    host, wall, _ = _gpu_times(empty_batch)
    record(
        metric="host_us_per_step",
        value=host,
        unit="us",
        baseline="an empty Python call",
        baseline_value=per_call_us(lambda: None),
        wall_us_per_step=wall,
        device=torch.cuda.get_device_name(0),
    )


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("shape", list(RANS_SHAPES))
@pytest.mark.parametrize("op", RANS_OPS)
def test_gpu_rans_host_us_and_wall_vs_kernel(op: str, shape: str, record) -> None:
    """The coder's calls with real launches. A whole call waits for its kernel (the checks
    read back), so its host time is its wall time; ``*_before_sync`` is what the host pays
    before that wait, ``rans_encode_after_sync`` what an encode pays after it. The uncached
    path (plans dropped every call) is timed alongside."""
    case = rans_case(shape, torch.device("cuda"))
    calls = rans_calls(case, "triton")
    whole = calls[whole_call(op)]
    whole()  # builds the plan
    host, wall, kernel = _gpu_times(calls[op])

    def uncached() -> object:
        rans_plans.clear_plans()
        return whole()

    no_plan = None if op != whole_call(op) else _gpu_times(uncached)[0]
    lanes, n = RANS_SHAPES[shape]
    record(
        metric="wall_us_per_call",
        value=wall,
        unit="us",
        baseline="GPU kernel time per call (torch.profiler)",
        baseline_value=kernel,
        host_us_per_call=host,
        no_plan_host_us_per_call=no_plan,
        tensor_ops_per_call=tensor_ops(calls[op]),
        budget_us=BUDGET_US,
        meets_budget=host <= BUDGET_US,
        lanes=lanes,
        symbols_per_lane=n,
        lanes_per_stream=case["group"],
        chunk_memory="device",
        device=torch.cuda.get_device_name(0),
    )


# ---------------------------------------------------------------------------------------
# a store / retrieve of a whole prompt: host time before its first copy is queued
# ---------------------------------------------------------------------------------------

PROMPT_CHUNKS = 4


def _first_copy_engine() -> tuple[CacheEngine, torch.Tensor, dict[str, float]]:
    """An engine over the benchmark's cache (room for the prompt twice in its CPU tier),
    the prompt's slots, and where it notes when the first copy of a call was queued."""
    paged = make_case(torch.device("cpu"))["paged"]
    nbytes = PROMPT_CHUNKS * 2 * LAYERS * CHUNK * HEADS * HEAD_SIZE * DTYPE.itemsize
    config = load_config({"max_local_cpu_size": 2 * nbytes / 2**30, "kernel_backend": "interpret"})
    engine = CacheEngine(config, EngineMetadata("bench"), paged)
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)[: PROMPT_CHUNKS * CHUNK // BLOCK_SIZE]
    slots = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()
    first: dict[str, float] = {}
    io = engine.paged_io
    for name in ("from_engine", "to_engine"):
        copy = getattr(io, name)

        def noted(*args, copy=copy):
            first.setdefault("at", time.perf_counter())
            return copy(*args)

        setattr(io, name, noted)
    return engine, slots, first


def _us_to_first_copy(call, setup, first: dict[str, float], rounds: int = 41) -> float:
    """Median over ``rounds`` calls of the host time from ``call``'s start to its first copy."""
    times = []
    for i in range(rounds + 3):
        setup()
        first.clear()
        started = time.perf_counter()
        call()
        if i >= 3:
            times.append(first["at"] - started)
    return statistics.median(times) * 1e6


@pytest.mark.parametrize("op", ["store", "retrieve"])
def test_host_us_before_the_first_copy_of_a_prompt(op: str, record) -> None:
    pytest.importorskip("triton")
    engine, slots, first = _first_copy_engine()
    tokens = torch.arange(PROMPT_CHUNKS * CHUNK)
    whole = engine.chunker.chunks  # the prompt hashed whole first
    if op == "store":
        calls = (
            lambda: engine.store(tokens, slot_mapping=slots),
            lambda: engine.store_chunks(whole(tokens), slots),
        )
        setup = engine.clear
    else:
        engine.store(tokens, slot_mapping=slots)
        calls = (
            lambda: engine.retrieve(tokens, slot_mapping=slots),
            lambda: engine.retrieve_chunks(whole(tokens), slots),
        )
        setup = lambda: None  # noqa: E731
    with record_launches() as recorder:
        new, old = [], []
        for _ in range(3):  # the two paths in alternation: load elsewhere weighs on both
            new.append(_us_to_first_copy(calls[0], setup, first, rounds=15))
            old.append(_us_to_first_copy(calls[1], setup, first, rounds=15))
        whole_call = per_call_us(lambda: (setup(), calls[0]()), calls=20, rounds=3)
    engine.close()
    assert recorder.calls > 0, "the recorder saw no launch: the row would time nothing"
    record(
        metric="host_us_before_first_copy",
        value=statistics.median(new),
        unit="us",
        baseline="the prompt hashed whole before its first chunk is staged",
        baseline_value=statistics.median(old),
        whole_call_us=whole_call,
        chunks=PROMPT_CHUNKS,
        tokens=PROMPT_CHUNKS * CHUNK,
        device="cpu (launch recorded, not run)",
    )
