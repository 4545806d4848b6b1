"""The cached launch state of the kernels (kvtier_kernels.paged.plans, kvtier_kernels.rope.plans,
kvtier_kernels.cachegen.rans.plans, kvtier_kernels._launch.BoundLaunch): a plan serves only
the cache and the geometry it was built for, a re-registered cache never sees stale
addresses, results stay bit-exact against the torch reference under Triton's interpreter,
a cached call does no tensor work it need not (no read-back of slots, no allocation), and
a cached rANS decode still rejects every stream the reference rejects."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from support.kv import fill_random_
from support.rans_cases import DAMAGES, as_tensors, assert_stream_equal, make_lanes, outcome
from torch.utils._python_dispatch import TorchDispatchMode

from kvtier.paged_io import PagedIO
from kvtier_kernels import PagedKV, gather, rerotate, scatter
from kvtier_kernels._launch import record_launches
from kvtier_kernels.cachegen.rans import CodecError, rans_decode_lanes, rans_encode_lanes
from kvtier_kernels.cachegen.rans import plans as rans_plans
from kvtier_kernels.cachegen.rans.decode import rans_decode, rans_decode_triton
from kvtier_kernels.cachegen.rans.encode import rans_encode, rans_encode_triton
from kvtier_kernels.paged import copy as paged_copy
from kvtier_kernels.paged import gather_reference, scatter_reference
from kvtier_kernels.paged.rows import launch_cache
from kvtier_kernels.rope import rerotate_reference

pytest.importorskip("triton")

BACKEND = "interpret"


def make_cache(seed: int, num_blocks: int = 6, layout: str = "vllm_nhd") -> PagedKV:
    paged = PagedKV.empty(
        layout, num_layers=3, num_blocks=num_blocks, block_size=4, num_heads=2, head_size=8
    )
    for t in paged.tensors:
        fill_random_(t, torch.Generator().manual_seed(seed))
    return paged


def gathered(paged: PagedKV, slots: torch.Tensor, layers: range | None = None) -> torch.Tensor:
    n = len(layers) if layers is not None else paged.num_layers
    out = torch.zeros(paged.chunk_shape(len(slots), n), dtype=paged.dtype)
    gather(paged, slots, out, layers, backend=BACKEND)
    expected = gather_reference(paged, slots, torch.zeros_like(out), layers)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    return out


def test_a_second_cache_gets_plans_of_its_own() -> None:
    first, second = make_cache(1), make_cache(2)
    slots = torch.tensor([5, -1, 0, 17])
    a, b = gathered(first, slots), gathered(second, slots)
    assert not torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert launch_cache(first) is not launch_cache(second)
    again = gathered(first, slots)  # its own plan, cached: still its own bytes
    assert torch.equal(again.view(torch.int16), a.view(torch.int16))


def test_another_shape_gets_another_plan_on_the_same_cache() -> None:
    paged = make_cache(3)
    plans_before = len(launch_cache(paged))
    gathered(paged, torch.tensor([1, 2, 3]))
    gathered(paged, torch.tensor([9, -1, 4, 22, 8]))  # another token count
    gathered(paged, torch.tensor([7, 6]), range(1, 2))  # one layer (layer-wise)
    gathered(paged, torch.tensor([7, 6], dtype=torch.int32), range(0, 3, 2))  # int32, stride 2
    assert len(launch_cache(paged)) >= plans_before + 4
    src = torch.zeros(paged.chunk_shape(2, 1), dtype=paged.dtype)
    fill_random_(src, torch.Generator().manual_seed(4))
    expected = PagedKV(paged.layout, [t.clone() for t in paged.tensors])
    scatter_reference(expected, torch.tensor([3, 11]), src, range(2, 3))
    scatter(paged, torch.tensor([3, 11]), src, range(2, 3), backend=BACKEND)
    for got, want in zip(paged.tensors, expected.tensors, strict=True):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_a_cache_registered_again_never_uses_stale_addresses() -> None:
    paged = make_cache(5)
    slots = torch.tensor([0, 4, 8, 13])
    before = gathered(paged, slots)
    fresh = make_cache(6)
    paged.tensors = fresh.tensors  # the engine re-allocated its cache (a reset)
    after = gathered(paged, slots).view(torch.int16)
    assert torch.equal(after, gathered(fresh, slots).view(torch.int16))
    assert not torch.equal(after, before.view(torch.int16))
    # the same list, its memory moved under it (set_ to a new storage)
    moved = make_cache(7)
    for t, new in zip(paged.tensors, moved.tensors, strict=True):
        t.set_(new.clone())
    got, want = gathered(paged, slots), gathered(moved, slots)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_an_engine_bound_again_after_a_reset_copies_from_the_new_cache() -> None:
    old, new = make_cache(8), make_cache(9)
    slots = torch.tensor([2, 3, 9, -1])
    chunk = torch.zeros(old.chunk_shape(4), dtype=old.dtype)
    PagedIO(old, BACKEND).from_engine(chunk, slots)
    io = PagedIO(new, BACKEND)  # what CacheEngine.bind does with the new cache
    got = torch.zeros_like(chunk)
    io.from_engine(got, io.device_slots(slots))
    expected = gather_reference(new, slots, torch.zeros_like(chunk))
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


def test_a_plan_built_while_recording_launches_for_real_afterwards() -> None:
    paged = make_cache(10)
    slots = torch.tensor([1, 14, -1])
    out = torch.zeros(paged.chunk_shape(3), dtype=paged.dtype)
    with record_launches() as recorder:
        gather(paged, slots, out, backend=BACKEND)
    assert recorder.calls == 1 and not out.view(torch.int16).any()  # recorded, not run
    name, grid, args = recorder.last
    assert name == "paged_copy_kernel" and grid[1:] == (3, 2) and args[1] is slots
    gathered(paged, slots)  # the same plan, launched


class TensorOps(TorchDispatchMode):
    """Every ATen op run inside it (allocations, copies, reductions, views)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def test_a_cached_copy_reads_no_slots_back_and_allocates_nothing() -> None:
    paged = make_cache(11)
    slots = torch.tensor([3, 0, 20, -1])
    chunk = torch.zeros(paged.chunk_shape(4), dtype=paged.dtype)
    io = PagedIO(paged, BACKEND)
    with record_launches():
        io.from_engine(chunk, slots)  # builds the plans
        paged_copy.gather_triton(paged, slots, chunk, interpret=True)
        with TensorOps() as host_slots:
            io.from_engine(chunk, slots)
        with TensorOps() as trusted:  # the Triton backend's own entry: slots already checked
            paged_copy.gather_triton(paged, slots, chunk, interpret=True)
    # host slots are range-checked on the host copy (no device there to sync with)
    assert set(host_slots.ops) <= {"max", "_local_scalar_dense", "view", "detach"}, host_slots.ops
    # what a GPU caller's device slots take: nothing but the interpreter's word view
    assert set(trusted.ops) <= {"view", "detach"}, trusted.ops
    assert "empty" not in host_slots.ops and "_to_copy" not in host_slots.ops


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within bf16 rounding (the interpreter truncates fp32 -> bf16)."""
    return torch.allclose(got.float(), want.float(), atol=2**-6, rtol=2**-6)


def test_a_cached_rotation_allocates_nothing() -> None:
    gen = torch.Generator().manual_seed(12)
    k = torch.randn(2, 5, 16, generator=gen).to(torch.bfloat16)
    old = torch.arange(5) + 100
    new = old - 30
    first = rerotate(k.clone(), old, new, head_size=8, backend=BACKEND)  # builds the plan
    cached = rerotate(k.clone(), old, new, head_size=8, backend=BACKEND)
    assert torch.equal(first.view(torch.int16), cached.view(torch.int16))
    assert close(cached, rerotate_reference(k.clone(), old, new, head_size=8))
    with record_launches() as recorder, TensorOps() as seen:
        rerotate(k, old, new, head_size=8, backend=BACKEND)
    assert recorder.calls == 1 and seen.ops == [], seen.ops
    # another shape and pairing: a plan of its own, still right
    k2 = torch.randn(1, 3, 16, generator=gen).to(torch.bfloat16)
    want = rerotate_reference(k2.clone(), old[:3], new[:3], head_size=8, is_neox_style=False)
    got = rerotate(k2, old[:3], new[:3], head_size=8, is_neox_style=False, backend=BACKEND)
    assert close(got, want)


def test_a_compiled_launcher_that_refuses_the_call_falls_back_to_jit_once(monkeypatch) -> None:
    """Where a Triton's compiled launcher takes arguments differently from the ones kvtier
    was checked with, the bound launch warns once and launches through ``kernel[grid]``
    from then on: never an exception to the engine, never a call lost."""
    from kvtier_kernels import _launch, _triton_compat

    launched: list[tuple] = []

    class RefusingCompiled:
        def __getitem__(self, grid):
            def runner(*args, stream=None):
                raise TypeError("function takes exactly 9 arguments (7 given)")

            return runner

    class Jit:
        def __getitem__(self, grid):
            return lambda *args, **meta: launched.append((grid, args, meta))

    def kernel_fn(a, b, n, BLOCK):
        pass

    kernel = _launch.LazyKernel(kernel_fn)
    monkeypatch.setattr(kernel, "get", lambda interpret: Jit())
    monkeypatch.setattr(_triton_compat, "current_stream_getter", lambda: lambda index: None)
    bound = _launch.BoundLaunch(
        kernel, False, (4,), {"BLOCK": 8}, RefusingCompiled(), None, fixed=(16,)
    )
    monkeypatch.setattr(_triton_compat, "current_device_getter", lambda: lambda: None)
    with pytest.warns(RuntimeWarning, match="refused kernel_fn"):
        bound("a", "b")
    bound("c", "d")
    assert launched == [((4,), ("a", "b", 16), {"BLOCK": 8}), ((4,), ("c", "d", 16), {"BLOCK": 8})]


class _Compiled:
    """A compiled kernel as Triton 3.2 to 3.9 shape it: handles loaded by ``[grid]``, then
    ``run`` with the grid, stream, function, metadata and hooks before the arguments."""

    def __init__(self) -> None:
        self.runs: list[tuple] = []
        self.function = None

    def __getitem__(self, grid):
        self.function, self.packed_metadata = "fn-handle", ("packed",)
        return lambda *args, stream=None: self.runs.append(("runner", grid, args, stream))

    def run(self, *args):
        self.runs.append(("run", *args))


def test_a_bound_launch_calls_tritons_c_launcher_directly() -> None:
    """The direct launcher passes the grid, the stream, the function handle and the packed
    metadata, no launch metadata and no hooks, then the kernel's arguments: what
    ``compiled[grid]`` passes when no hook is installed, without its per-call wrapper."""
    from kvtier_kernels import _triton_compat

    compiled = _Compiled()
    launch = _triton_compat.direct_launcher(compiled, (3, 2))
    assert launch is not None
    launch("a", 7, stream=42)
    assert compiled.runs == [
        ("run", 3, 2, 1, 42, "fn-handle", ("packed",), None, None, None, "a", 7)
    ]


def test_installed_launch_hooks_keep_tritons_own_runner(monkeypatch) -> None:
    """With a launch hook installed (a profiler), the bound launch goes through
    ``compiled[grid]``, which calls the hooks."""
    import triton

    from kvtier_kernels import _triton_compat

    hook = triton.knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):  # a HookChain (Triton >= 3.7)
        hook.add(_a_hook)
        try:
            assert _triton_compat.direct_launcher(_Compiled(), (1,)) is None
        finally:
            hook.remove(_a_hook)
        assert _triton_compat.direct_launcher(_Compiled(), (1,)) is not None
        return
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", _a_hook)
    assert _triton_compat.direct_launcher(_Compiled(), (1,)) is None


def _a_hook(metadata) -> None:
    pass


# ---------------------------------------------------------------------------------------
# the rANS coder's plans
# ---------------------------------------------------------------------------------------


def coded(lanes: int, n: int, alphabet: int, seed: int, distribution: str = "skewed") -> tuple:
    """``(symbols, freq, words, lengths)`` as tensors, with the reference's stream."""
    symbols, freq = make_lanes(lanes, n, alphabet, distribution, seed=seed)
    words, lengths = rans_encode(symbols, freq)
    sym_t, freq_t = as_tensors(symbols, freq)
    return sym_t, freq_t, torch.from_numpy(words.astype(np.int64)), torch.from_numpy(lengths)


def round_trip(sym_t: torch.Tensor, freq_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode and decode through the public entries, bit-exact against the reference;
    returns the stream."""
    symbols, freq = sym_t.numpy(), freq_t.numpy().astype(np.uint32)
    ref_words, ref_lengths = rans_encode(symbols, freq)
    words, lengths = rans_encode_lanes(sym_t, freq_t, backend=BACKEND)
    assert_stream_equal(words, lengths, ref_words, ref_lengths)
    decoded = rans_decode_lanes(words, lengths, freq_t, sym_t.shape[1], backend=BACKEND)
    np.testing.assert_array_equal(decoded.numpy(), symbols)
    return words, lengths


def test_rans_plans_serve_a_second_call_and_a_second_shape() -> None:
    sym_a, freq_a, _, _ = coded(5, 9, 7, seed=1)
    round_trip(sym_a, freq_a)  # builds the plans
    encode_plan = rans_plans.cached_plan(rans_plans.encode_key(BACKEND, sym_a, freq_a, 1))
    assert isinstance(encode_plan, rans_plans.EncodePlan)
    other = coded(5, 9, 7, seed=2)[:2]  # the same shapes, other data: the same plan
    round_trip(*other)
    assert rans_plans.cached_plan(rans_plans.encode_key(BACKEND, *other, 1)) is encode_plan
    sym_b, freq_b, _, _ = coded(3, 14, 11, seed=3)  # another shape: a plan of its own
    round_trip(sym_b, freq_b)
    assert rans_plans.cached_plan(rans_plans.encode_key(BACKEND, sym_b, freq_b, 1)) is not (
        encode_plan
    )
    # the Triton launchers with the backend picked by the tensors' device, no interpret given
    words, lengths = rans_encode_triton(sym_b, freq_b)
    decoded = rans_decode_triton(words, lengths, freq_b, 14)
    assert torch.equal(decoded, sym_b)


def test_rans_plans_are_rebuilt_after_clear_plans() -> None:
    sym_t, freq_t, _, _ = coded(4, 6, 5, seed=4)
    words, lengths = round_trip(sym_t, freq_t)
    key = rans_plans.decode_key(BACKEND, words, lengths, freq_t, 6, 1)
    first = rans_plans.cached_plan(key)
    assert first is not None
    rans_plans.clear_plans()
    assert rans_plans.cached_plan(key) is None
    round_trip(sym_t, freq_t)
    assert rans_plans.cached_plan(key) not in (None, first)


def test_cpu_encodes_take_their_scratch_from_one_buffer_per_thread() -> None:
    """On the CPU a thread's encodes reuse one scratch, grown to its largest call, whatever
    their plans; each stays bit-exact against the reference, another thread has its own."""
    small, large = coded(3, 5, 4, seed=21)[:2], coded(6, 40, 9, seed=22)[:2]
    for case in (small, large, small, large, small):  # data a larger call left behind
        round_trip(*case)
    calls = [
        (rans_plans.cached_plan(rans_plans.encode_key(BACKEND, *c, 1)), c) for c in (large, small)
    ]

    def scratch_addresses() -> list[int]:  # the larger call first, then the smaller
        with record_launches():
            scratches = [plan.enqueue(*case)[0] for plan, case in calls]  # all held at once
        return [scratch.data_ptr() for scratch in scratches]

    here = scratch_addresses()
    assert here[0] == here[1] == scratch_addresses()[0]
    elsewhere: list[int] = []
    thread = threading.Thread(target=lambda: elsewhere.extend(scratch_addresses()))
    thread.start()
    thread.join()
    assert elsewhere[0] == elsewhere[1] != here[0]


def test_a_rans_plan_built_while_recording_runs_for_real_afterwards() -> None:
    rans_plans.clear_plans()
    sym_t, freq_t, words, lengths = coded(6, 5, 9, seed=5)
    with record_launches() as recorder:
        _, recorded_lengths = rans_encode_lanes(sym_t, freq_t, backend=BACKEND)
        rans_decode_lanes(words, lengths, freq_t, 5, backend=BACKEND)  # nothing decoded
    assert recorder.calls == 2 and not recorded_lengths.any()  # recorded, not run
    name, grid, args = recorder.last
    assert name == "rans_decode_kernel" and grid == (1,) and args[0] is words
    round_trip(sym_t, freq_t)  # the same plans, launched


def test_a_rans_decode_plan_serves_every_word_count_of_its_shapes() -> None:
    """The words' length is passed per call: streams of one shape and different lengths
    share a plan (within the classes Triton specializes on) and each decodes right."""
    cases = [coded(4, 40, 30, seed, "uniform") for seed in (6, 8, 10, 12)]  # 50, 48, 47, 49
    assert len({len(words) for _, _, words, _ in cases}) == 4
    plans = []
    for sym_t, freq_t, words, lengths in cases:
        decoded = rans_decode_lanes(words, lengths, freq_t, 40, backend=BACKEND)
        assert torch.equal(decoded, sym_t)
        key = rans_plans.decode_key(BACKEND, words, lengths, freq_t, 40, 1)
        plans.append(rans_plans.cached_plan(key))
    assert plans[0] is plans[2] is plans[3]  # 50, 47, 49 words: one plan
    assert plans[1] is not plans[0]  # 48 words, a multiple of 16: specialized apart


def test_a_cached_rans_decode_still_rejects_what_the_reference_rejects() -> None:
    sym_t, freq_t, words, lengths = coded(5, 7, 6, seed=9)
    assert torch.equal(rans_decode_lanes(words, lengths, freq_t, 7, backend=BACKEND), sym_t)
    damaged = words.clone()
    damaged[3] ^= 0x5A5A  # same shapes: the cached plan
    expected = pytest.raises(CodecError)
    with expected:
        rans_decode(damaged.numpy().astype(np.uint16), lengths.numpy(), freq_t.numpy(), 7)
    with pytest.raises(CodecError, match="inconsistent"):
        rans_decode_lanes(damaged, lengths, freq_t, 7, backend=BACKEND)
    shifted = lengths.clone()
    shifted[0] += 1
    shifted[1] -= 1
    with pytest.raises(CodecError):
        rans_decode_lanes(words, shifted, freq_t, 7, backend=BACKEND)
    bad_table = freq_t.clone()
    bad_table[2, 0] += 1
    with pytest.raises(ValueError, match="freq row of lane 2"):
        rans_decode_lanes(words, lengths, bad_table, 7, backend=BACKEND)
    with pytest.raises(ValueError, match="n must be an int"):  # True == 1, a key apart
        rans_decode_lanes(words[:0], lengths[:0], freq_t[:0], True, backend=BACKEND)
    rans_decode_lanes(words[:0], lengths[:0], freq_t[:0], 1, backend=BACKEND)
    with pytest.raises(ValueError, match="n must be an int"):
        rans_decode_lanes(words[:0], lengths[:0], freq_t[:0], True, backend=BACKEND)


def test_a_cached_rans_encode_still_rejects_symbols_without_frequency() -> None:
    sym_t, freq_t, _, _ = coded(4, 6, 5, seed=10)
    rans_encode_lanes(sym_t, freq_t, backend=BACKEND)
    zero = freq_t.clone()
    used = int(sym_t[1, 0])
    zero[1, (used + 1) % 5] += zero[1, used]
    zero[1, used] = 0
    with pytest.raises(ValueError, match="lane 1 uses a symbol"):
        rans_encode_lanes(sym_t, zero, backend=BACKEND)


def test_a_cached_rans_call_reads_back_only_after_its_launch() -> None:
    """What a cached call queues before its one sync: its buffers, then the launch (the
    kernels build the cumulative tables); no read-back."""
    sym_t, freq_t, words, lengths = coded(4, 6, 5, seed=11)
    rans_encode_lanes(sym_t, freq_t, backend=BACKEND)
    rans_decode_lanes(words, lengths, freq_t, 6, backend=BACKEND)
    encode = rans_plans.cached_plan(rans_plans.encode_key(BACKEND, sym_t, freq_t, 1))
    decode = rans_plans.cached_plan(rans_plans.decode_key(BACKEND, words, lengths, freq_t, 6, 1))
    with record_launches() as recorder:
        with TensorOps() as encoding:
            encode.enqueue(sym_t, freq_t)
        with TensorOps() as decoding:
            decode.enqueue(words, lengths, freq_t)
    assert recorder.calls == 2
    for ops in (encoding.ops, decoding.ops):
        assert "_local_scalar_dense" not in ops and "item" not in ops, ops
    encode_ops = {"cumsum", "sub_", "_to_copy", "empty", "zeros", "zero_", "slice", "view"}
    assert set(encoding.ops) <= encode_ops  # slice, view: the CPU's scratch
    assert set(decoding.ops) <= {"cumsum", "sub_", "full", "slice", "empty", "zeros", "zero_"}


def assert_same_outcome_exactly(expected: tuple, got: tuple) -> None:
    """The same symbols, or the same error type and message, word for word."""
    assert got[0] == expected[0], f"torch: {expected}, cached plan: {got}"
    if got[0] == "ok":
        np.testing.assert_array_equal(got[1], expected[1])
    else:
        assert got[1] == expected[1]


def _bad_table_and_short_lane(words, lengths, freq, n):
    freq, lengths = freq.astype(np.int64), lengths.copy()
    freq[3, 0] += 1
    lengths[1] = 1
    return words, lengths, freq, n


def _negative_entry(words, lengths, freq, n):
    freq = freq.astype(np.int64)
    freq[2, 0] -= 1 << 17  # the row still sums to PROB_SCALE
    freq[2, 1] += 1 << 17
    return words, lengths, freq, n


def _short_lane_and_mismatch(words, lengths, freq, n):
    lengths = lengths.copy()
    lengths[4] = 0
    return words, lengths, freq, n


ERRORS = [
    *DAMAGES,
    ("bad table and short lane", _bad_table_and_short_lane),
    ("negative entry", _negative_entry),
    ("short lane and length mismatch", _short_lane_and_mismatch),
]


@pytest.mark.parametrize("damage", [d for _, d in ERRORS], ids=[name for name, _ in ERRORS])
def test_a_cached_rans_decode_raises_what_the_torch_backend_raises(damage) -> None:
    """A damaged stream decoded twice (the plan built, then served from the cache): both
    times the torch backend's symbols, or its error word for word, the first check that
    fails in the torch backend's order (tables, short lanes, lengths' sum, streams)."""
    symbols, freq = make_lanes(5, 40, 33, "skewed", seed=3)
    words, lengths = rans_encode(symbols, freq)
    words, lengths, freq, n = damage(words, lengths, freq, 40)
    args = (
        torch.from_numpy(words.astype(np.int32)),
        torch.from_numpy(lengths.astype(np.int64)),
        torch.from_numpy(freq.astype(np.int64)),
        n,
    )
    expected = outcome(lambda: rans_decode_lanes(*args, backend="torch"))
    rans_plans.clear_plans()
    for _ in range(2):
        assert_same_outcome_exactly(expected, outcome(lambda: rans_decode_lanes(*args, BACKEND)))


@pytest.mark.parametrize("damage", ["table", "negative entry", "symbols", "table and symbols"])
def test_a_cached_rans_encode_raises_what_the_torch_backend_raises(damage: str) -> None:
    """Bad tables and symbols without frequency, encoded twice (a plan miss, then a hit):
    both times the torch backend's error word for word, a bad table first."""
    symbols, freq = make_lanes(6, 8, 5, "dense", seed=14)  # every symbol has a frequency
    sym_t, freq_t = as_tensors(symbols, freq)
    if "table" in damage:
        freq_t[4, 1] += 1
    if damage == "negative entry":
        freq_t[2, 0] -= 1 << 17
        freq_t[2, 1] += 1 << 17
    if "symbols" in damage:
        used = int(sym_t[1, 0])
        freq_t[1, (used + 1) % 5] += freq_t[1, used]
        freq_t[1, used] = 0
        sym_t[3, 2] = 7  # past the alphabet
    expected = outcome(lambda: rans_encode_lanes(sym_t, freq_t, backend="torch"))
    assert expected[0] == "ValueError"
    rans_plans.clear_plans()
    for _ in range(2):
        got = outcome(lambda: rans_encode_lanes(sym_t, freq_t, backend=BACKEND))
        assert_same_outcome_exactly(expected, got)


def test_rans_plans_are_keyed_by_tables_per_stream() -> None:
    """Streams of several lanes: one plan per ``tables_per_stream`` (a kernel argument the
    segment length follows from), bit-exact against the reference; a bool is no int."""
    symbols, freq = make_lanes(6, 4, 9, "dense", seed=13)
    streams = symbols.reshape(2, 12)  # 3 lanes of 4 symbols a stream
    ref_words, ref_lengths = rans_encode(streams, freq, 3)
    sym_t, freq_t = as_tensors(streams, freq)
    for _ in range(2):  # a miss, then a hit
        words, lengths = rans_encode_lanes(sym_t, freq_t, BACKEND, tables_per_stream=3)
        assert_stream_equal(words, lengths, ref_words, ref_lengths)
        decoded = rans_decode_lanes(words, lengths, freq_t, 12, BACKEND, tables_per_stream=3)
        np.testing.assert_array_equal(decoded.numpy(), streams)
    encode = rans_plans.cached_plan(rans_plans.encode_key(BACKEND, sym_t, freq_t, 3))
    decode = rans_plans.cached_plan(rans_plans.decode_key(BACKEND, words, lengths, freq_t, 12, 3))
    assert isinstance(encode, rans_plans.EncodePlan) and isinstance(decode, rans_plans.DecodePlan)
    assert rans_plans.cached_plan(rans_plans.encode_key(BACKEND, sym_t, freq_t, 1)) is None
    with pytest.raises(ValueError, match="freq must have shape"):  # 6 rows for 2 x 1 lanes
        rans_encode_lanes(sym_t, freq_t, BACKEND, tables_per_stream=1)
    with pytest.raises(ValueError, match="tables_per_stream must be an int"):
        rans_encode_lanes(sym_t[:, :6], freq_t, BACKEND, tables_per_stream=True)
    rans_encode_lanes(sym_t[:, :6], freq_t[:2], BACKEND, tables_per_stream=1)
    with pytest.raises(ValueError, match="tables_per_stream must be an int"):  # True == 1
        rans_encode_lanes(sym_t[:, :6], freq_t[:2], BACKEND, tables_per_stream=True)
    with pytest.raises(CodecError, match="2 lengths for 3 lanes"):
        rans_decode_lanes(words, lengths, freq_t, 12, BACKEND, tables_per_stream=2)


def test_rans_encode_reads_a_transposed_table_through_its_strides() -> None:
    symbols, freq = make_lanes(6, 10, 7, "uniform", seed=12)
    ref_words, ref_lengths = rans_encode(symbols, freq)
    freq_t = torch.from_numpy(np.ascontiguousarray(freq.T.astype(np.int64))).t()  # (1, lanes)
    words, lengths = rans_encode_lanes(torch.from_numpy(symbols), freq_t, backend=BACKEND)
    assert_stream_equal(words, lengths, ref_words, ref_lengths)


def test_plan_cache_keeps_the_newest_and_takes_puts_from_many_threads() -> None:
    import threading

    from kvtier_kernels.plan_cache import PlanCache

    cache = PlanCache(8)
    for i in range(20):
        cache.put(i, str(i))
    assert [cache.get(i) for i in range(11, 20)] == [None] + [str(i) for i in range(12, 20)]

    def fill(offset: int) -> None:
        for i in range(2000):
            cache.put((offset, i), i)
            cache.get((offset, i - 1))

    threads = [threading.Thread(target=fill, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len([k for k in range(2000) if cache.get((0, k)) is not None]) <= 8
    cache.clear()
    assert cache.get((0, 1999)) is None
