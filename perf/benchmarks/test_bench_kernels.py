"""Kernel bandwidth: paged gather / scatter and RoPE re-rotation at a realistic shape.

Shape: 32 layers, 8 KV heads, head size 128, bf16, one 256-token chunk (32 MiB of K and V;
16 MiB of K), in a paged cache in vLLM's current GPU layout (``vllm_nhd``, block size 16)
of 128 blocks, the chunk's 16 blocks drawn at random (a random block table). Gather and
scatter move every layer in one call; re-rotation rotates the chunk's K plane in place
from the positions it was stored at to positions 3072 earlier. Every figure is GB/s of
payload (each byte is read once and written once, as in a copy) with the ratio against a
ceiling measured in the same run:

- chunk in device memory: a plain copy of the same bytes between two dense buffers on the
  same device (``dst.copy_(src)``: the HBM ceiling on a GPU, "raw torch copy" on the CPU);
- chunk in pinned host memory (GPU only): ``copy_(non_blocking=True)`` of the same bytes
  between device memory and pinned memory, in the op's direction (the bus ceiling);
- RoPE: the device copy of the K plane's bytes.

An op and its ceiling (and, for Triton, the torch backend) are timed in alternation, one
call of each per round, median of ``REPEATS`` rounds after a warm-up, so that a change in
the machine's load weighs on all of them alike. On a GPU each call is timed with CUDA
events, the L2 cache flushed before it (``kvtier_kernels.tuning.sweep.event_timer``, what
``kvtier tune`` times with); the backends are ``triton`` and ``torch`` (the reference
path a connector falls back to). The Triton rows carry the design targets
(``target_ratio``: 0.9 of the ceiling for gather/scatter, 0.7 for RoPE; ``meets_target``)
and the torch backend's figure from the same run; speed is measured here, never asserted.
Every result is checked once against the torch reference before it is timed: bit for bit
for gather and scatter, within one bf16 ulp for RoPE (the kernel's fp32 cos/sin may flip
a last-bit rounding; see ``tests/test_rope.py``).

On the CPU only the torch backend is timed (wall clock): Triton's interpreter costs about
a millisecond per program instance, so its figures would say nothing about the kernels,
and a pinned host chunk is distinct from the cache's memory only on a GPU; those rows are
skipped with the reason, pending a GPU run.

NOTE: on a GPU the slot mapping lives on the device, where a serving engine's transfer
places it once per request (``PagedIO.device_slots``, range-checked there on its host
copy): the Triton plans then launch without a sync or a copy. Slots in host memory cost a
range check and a copy to the device per call (``test_bench_launch.py`` times both); the
torch backend checks device slots with ``max()``, a sync per call, as its ops would fault.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable

import pytest
import torch

from kvtier_kernels import PagedKV, gather, rerotate, scatter
from kvtier_kernels.dtypes import bits, fill_random_bits_
from kvtier_kernels.paged import gather_reference, scatter_reference
from kvtier_kernels.rope import rerotate_reference
from kvtier_kernels.tuning import sweep

LAYERS, HEADS, HEAD_SIZE, CHUNK = 32, 8, 128, 256
DTYPE = torch.bfloat16
LAYOUT = "vllm_nhd"
BLOCK_SIZE, NUM_BLOCKS = 16, 128
NBYTES = 2 * LAYERS * CHUNK * HEADS * HEAD_SIZE * DTYPE.itemsize  # a chunk: 32 MiB
K_NBYTES = NBYTES // 2  # its K plane
POSITION_SHIFT = -3072  # RoPE: the chunk reused 3072 positions before where it was stored
WARMUP, REPEATS = 3, 15
TARGETS = {"gather": 0.9, "scatter": 0.9, "rerotate": 0.7}  # Triton ÷ ceiling, on a GPU

HAS_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_GPU else "cpu")
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_NUMBA = importlib.util.find_spec("numba") is not None
PENDING = "GPU figures are pending a run on a GPU machine"


def _skip_untimeable(backend: str, placement: str = "device") -> None:
    if backend == "triton" and not HAS_GPU:
        pytest.skip(
            "the Triton kernels are timed on a GPU only: on the CPU they run in Triton's "
            f"interpreter (about 1 ms per program instance), whose figures mean nothing; {PENDING}"
        )
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    if placement == "pinned" and not HAS_GPU:
        pytest.skip(
            "a chunk in pinned host memory differs from one in the cache's memory only on a "
            f"GPU (reached over the bus); {PENDING}"
        )


# ---------------------------------------------------------------------------------------
# timing and checks
# ---------------------------------------------------------------------------------------


def _wall_timer(fn: Callable[[], object], warmup: int, repeats: int) -> list[float]:
    """A ``sweep.Timer`` on the wall clock (on the CPU every op returns when it is done)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


@pytest.fixture(scope="module")
def medians() -> Callable[..., list[float]]:
    """``medians(*fns)``: the median seconds of one call of each of ``fns``, timed in
    alternation (one call of each per round, ``REPEATS`` rounds after ``WARMUP`` calls of
    each). On a GPU: CUDA events with an L2 flush before every call; on the CPU: the wall
    clock."""
    timer = sweep.event_timer(DEVICE) if HAS_GPU else _wall_timer

    def _medians(*fns: Callable[[], object]) -> list[float]:
        for fn in fns:
            timer(fn, WARMUP, 0)
        rounds = [[timer(fn, 0, 1)[0] for fn in fns] for _ in range(REPEATS)]
        return [statistics.median(times) for times in zip(*rounds, strict=True)]

    return _medians


def _sync() -> None:
    if HAS_GPU:
        torch.cuda.synchronize()


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _assert_chunk_equal(got: torch.Tensor, want: torch.Tensor, slots: torch.Tensor) -> None:
    """Bit-compare two chunks; a mismatch is named by layer, plane, token, slot, head."""
    diff = bits(got.cpu()) != bits(want.cpu())
    if diff.any():
        plane, layer, token, col = (int(i) for i in diff.nonzero()[0])
        raise AssertionError(
            f"chunk differs from the torch reference at layer {layer}, kv plane {plane}, "
            f"token {token} (slot {int(slots[token])}), head {col // HEAD_SIZE}, dim "
            f"{col % HEAD_SIZE}; {int(diff.sum())} values differ"
        )


def _assert_cache_equal(got: PagedKV, want: PagedKV) -> None:
    """Bit-compare two caches; a mismatch is named by layer, plane, block, offset, head."""
    for layer in range(got.num_layers):
        diff = bits(got.layer_view(layer)) != bits(want.layer_view(layer))
        if diff.any():
            plane, block, offset, head, dim = (int(i) for i in diff.nonzero()[0])
            raise AssertionError(
                f"cache differs from the torch reference at layer {layer}, kv plane {plane}, "
                f"block {block}, offset {offset}, head {head}, dim {dim}"
            )


# ---------------------------------------------------------------------------------------
# the data
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def paged() -> PagedKV:
    cache = PagedKV.empty(
        LAYOUT,
        num_layers=LAYERS,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        num_heads=HEADS,
        head_size=HEAD_SIZE,
        dtype=DTYPE,
        device=DEVICE,
    )
    gen = torch.Generator().manual_seed(0)
    for layer in cache.tensors:
        layer.copy_(fill_random_bits_(torch.empty(layer.shape, dtype=DTYPE), gen))
    return cache


@pytest.fixture(scope="module")
def slots() -> torch.Tensor:
    """``[CHUNK]`` int64 slots of the chunk's tokens: a random block table, consecutive
    offsets inside each block (on the device on a GPU machine, see the module's NOTE)."""
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)[: CHUNK // BLOCK_SIZE]
    slots = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()
    return slots.to(DEVICE)


def _chunk(paged: PagedKV, placement: str) -> torch.Tensor:
    shape = paged.chunk_shape(CHUNK)
    if placement == "pinned":
        return torch.zeros(shape, dtype=DTYPE, pin_memory=True)
    return torch.zeros(shape, dtype=DTYPE, device=DEVICE)


def _ceiling(op: str, placement: str, nbytes: int) -> tuple[str, Callable[[], object]]:
    """(name, copy) of the copy of ``nbytes`` that bounds ``op`` with the chunk at
    ``placement``."""
    elems = nbytes // DTYPE.itemsize
    src = fill_random_bits_(torch.empty(elems, dtype=DTYPE), torch.Generator().manual_seed(2))
    if placement == "pinned":
        device_buffer, host_buffer = src.to(DEVICE), src.pin_memory()
        dst, src = (host_buffer, device_buffer) if op == "gather" else (device_buffer, host_buffer)
        direction = "device to host" if op == "gather" else "host to device"

        def pinned_copy() -> None:
            dst.copy_(src, non_blocking=True)

        return f"pinned copy_(non_blocking=True), {direction}", pinned_copy
    src = src.to(DEVICE)
    dst = torch.empty_like(src)
    name = "device-to-device copy" if HAS_GPU else "raw torch copy"
    return name, lambda: dst.copy_(src)


def _measure(
    record, medians, *, metric: str, backend: str, nbytes: int, run: Callable[[], object],
    run_torch: Callable[[], object], ceiling: tuple[str, Callable[[], object]], target: float,
    **fields,
) -> None:  # fmt: skip
    """Time ``run`` in alternation with the ceiling's copy and record one row: ``run``'s
    GB/s against the ceiling. Triton rows also carry the target and the torch backend's
    figure (``run_torch``, timed apart: alternated, its milliseconds of temporaries slowed
    the next call of ``run`` twofold on an H100)."""
    ceiling_name, ceiling_copy = ceiling
    gbps, ceiling_gbps = (_gbps(nbytes, s) for s in medians(run, ceiling_copy))
    torch_gbps = [_gbps(nbytes, medians(run_torch)[0])] if backend == "triton" else []
    row = dict(
        metric=metric, value=gbps, unit="GB/s", baseline=ceiling_name,
        baseline_value=ceiling_gbps, backend=backend, layers=LAYERS, kv_heads=HEADS,
        head_size=HEAD_SIZE, tokens=CHUNK, dtype="bfloat16", bytes=nbytes, **fields,
    )  # fmt: skip
    if torch_gbps:
        row.update(
            target_ratio=target,
            meets_target=gbps / ceiling_gbps >= target,
            torch_backend_gbps=torch_gbps[0],
            ratio_vs_torch_backend=gbps / torch_gbps[0],
        )
    record(**row)


# ---------------------------------------------------------------------------------------
# paged gather / scatter
# ---------------------------------------------------------------------------------------


def _paged_copy(op: str, paged: PagedKV, slots: torch.Tensor, chunk: torch.Tensor, backend: str):
    if op == "gather":
        return lambda: gather(paged, slots, chunk, backend=backend)
    return lambda: scatter(paged, slots, chunk, backend=backend)


def _check_paged_copy(op: str, paged: PagedKV, slots, chunk, backend: str) -> None:
    """Run ``op`` once with ``backend`` and compare it bit for bit with the reference."""
    if op == "gather":
        want = gather_reference(paged, slots, torch.zeros_like(chunk, device=DEVICE))
        chunk.zero_()
        gather(paged, slots, chunk, backend=backend)
        _sync()
        _assert_chunk_equal(chunk, want, slots)
        return
    fill_random_bits_(chunk, torch.Generator().manual_seed(3))  # differs from what is cached
    got = PagedKV(paged.layout, [t.clone() for t in paged.tensors])
    want = PagedKV(paged.layout, [t.clone() for t in paged.tensors])
    scatter_reference(want, slots, chunk.to(DEVICE))
    scatter(got, slots, chunk, backend=backend)
    _sync()
    _assert_cache_equal(got, want)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("placement", ["device", "pinned"])
@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_paged_copy(op, placement, backend, record, medians, paged, slots):
    _skip_untimeable(backend, placement)
    chunk = _chunk(paged, placement)
    _check_paged_copy(op, paged, slots, chunk, backend)

    where = "chunk in pinned host memory" if placement == "pinned" else f"chunk on {DEVICE.type}"
    _measure(
        record,
        medians,
        metric=f"kernel {op} ({backend} backend, {where})",
        backend=backend,
        nbytes=NBYTES,
        run=_paged_copy(op, paged, slots, chunk, backend),
        run_torch=_paged_copy(op, paged, slots, chunk, "torch"),
        ceiling=_ceiling(op, placement, NBYTES),
        target=TARGETS[op],
        layout=LAYOUT,
        block_size=BLOCK_SIZE,
        chunk_placement=placement,
    )


# ---------------------------------------------------------------------------------------
# RoPE re-rotation
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "torch", "numba"])
def test_rope_rerotate(backend, record, medians):
    _skip_untimeable(backend)
    if backend == "numba" and (DEVICE.type != "cpu" or not HAS_NUMBA):
        pytest.skip("the numba backend runs on the CPU, with numba installed (kvtier[cpu-codec])")
    gen = torch.Generator().manual_seed(4)
    chunk = torch.randn(2, LAYERS, CHUNK, HEADS * HEAD_SIZE, generator=gen).to(DTYPE).to(DEVICE)
    k = chunk[0]  # [L, T, H * D]: the K plane, rotated in place
    old = torch.arange(CHUNK, device=DEVICE) + 4096
    new = old + POSITION_SHIFT

    want = rerotate_reference(k.clone(), old, new, head_size=HEAD_SIZE)
    got = rerotate(k.clone(), old, new, head_size=HEAD_SIZE, backend=backend)
    if backend in ("torch", "numba"):
        assert torch.equal(bits(got), bits(want)), f"the {backend} backend is not the reference"
    else:  # one bf16 ulp is at most 2**-7 of the value
        torch.testing.assert_close(
            got.float(), want.float(), rtol=2**-7, atol=1e-6,
            msg=lambda m: f"rerotate ({backend}) vs the reference, index (layer, token, "
            f"head * {HEAD_SIZE} + dim): {m}",
        )  # fmt: skip

    def run(backend: str = backend) -> None:
        rerotate(k, old, new, head_size=HEAD_SIZE, backend=backend)

    _measure(
        record,
        medians,
        metric=f"kernel rope rerotate ({backend} backend, K on {DEVICE.type})",
        backend=backend,
        nbytes=K_NBYTES,
        run=run,
        run_torch=lambda: run("torch"),
        ceiling=_ceiling("rerotate", "device", K_NBYTES),
        target=TARGETS["rerotate"],
        rotary_dim=HEAD_SIZE,
        style="neox",
        position_shift=POSITION_SHIFT,
    )
