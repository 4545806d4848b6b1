"""The paged copies' numba backend against the torch reference, bit for bit: every layout,
word widths from 8 bytes down to 1, padding slots, layer subsets, per-layer storages, a
layer-wise chunk view, and the cases it hands to torch; the streaming stores it writes
with, and the fallback where they cannot be built."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch
from support.kv import (
    assert_cache_equal,
    assert_chunk_equal,
    clone_cache,
    fill_random_,
    make_slots,
)

from kvtier_kernels import _launch, registry
from kvtier_kernels._numba_stores import streaming_stores
from kvtier_kernels.layouts import LAYOUTS, PagedKV
from kvtier_kernels.paged import gather, gather_reference, numba_rows, scatter, scatter_reference

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("numba") is None, reason="needs numba (kvtier[cpu-codec])"
)

TOKENS = 37
FP8 = getattr(torch, "float8_e4m3fn", torch.int8)
# (layout, heads, head size, dtype): rows of 160 / 16 / 80 / 6 / 3 bytes (int64 .. int8 words)
CASES = [(name, 2, 80, torch.bfloat16) for name in sorted(LAYOUTS) if name != "mla"]
CASES += [
    ("vllm_cpu", 1, 8, torch.bfloat16),
    ("mla", 1, 80, FP8),
    ("flash_hnd", 3, 6, FP8),
    ("vllm_nhd", 2, 3, FP8),
    ("flash_nhd", 2, 16, torch.float32),
]


def make_cache(
    name: str, heads: int, head_size: int, dtype: torch.dtype, block_size: int, layers: int = 3
) -> PagedKV:
    paged = PagedKV.empty(
        name,
        num_layers=layers,
        num_blocks=2 * TOKENS // block_size + 2,
        block_size=block_size,
        num_heads=heads,
        head_size=head_size,
        dtype=dtype,
    )
    gen = torch.Generator().manual_seed(block_size)
    for t in paged.tensors:
        fill_random_(t, gen)
    return paged


def random_chunk(paged: PagedKV, tokens: int, layers: int, seed: int) -> torch.Tensor:
    chunk = torch.empty(paged.chunk_shape(tokens, layers), dtype=paged.dtype)
    return fill_random_(chunk, torch.Generator().manual_seed(seed))


def assert_round_trip_matches_reference(
    paged: PagedKV, slots: torch.Tensor, layers: range, chunk: torch.Tensor | None = None
) -> None:
    """numba gather and scatter of ``slots`` against the reference on clones of ``paged``."""
    out = random_chunk(paged, len(slots), len(layers), seed=1) if chunk is None else chunk
    expected = gather_reference(paged, slots, out.clone(), layers)
    assert gather(paged, slots, out, layers, backend="numba") is out
    assert_chunk_equal(out, expected, paged, slots, layers)

    src = random_chunk(paged, len(slots), len(layers), seed=2)
    want = clone_cache(paged)
    scatter_reference(want, slots, src, layers)
    scatter(paged, slots, src, layers, backend="numba")
    assert_cache_equal(paged, want)  # every slot not named, and every other layer, unchanged


@pytest.mark.parametrize(("name", "heads", "head_size", "dtype"), CASES, ids=str)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("layers", [range(3), range(2, -1, -2)], ids=["all", "2,0"])
def test_matches_the_reference_bit_for_bit(name, heads, head_size, dtype, block_size, layers):
    paged = make_cache(name, heads, head_size, dtype, block_size)
    slots = make_slots(paged.num_slots, TOKENS, pad_every=5, seed=block_size + 3)
    assert numba_rows.row_groups(paged, layers) is not None  # the numba path, not torch's
    assert_round_trip_matches_reference(paged, slots, layers)


def test_layers_in_storages_of_their_own() -> None:
    one = make_cache("vllm_cpu", 2, 64, torch.bfloat16, 16, layers=4)
    paged = PagedKV(one.layout, [t.clone() for t in one.tensors])  # four allocations
    groups = numba_rows.row_groups(paged, range(4))
    assert groups is not None and len(groups.groups) == 4
    assert len(numba_rows.row_groups(one, range(4)).groups) == 1  # views of one buffer
    slots = make_slots(paged.num_slots, TOKENS, pad_every=4, seed=5)
    assert_round_trip_matches_reference(paged, slots, range(4))


def test_a_layer_wise_view_of_a_chunk() -> None:
    paged = make_cache("flash_nhd", 2, 64, torch.bfloat16, 16)
    slots = make_slots(paged.num_slots, TOKENS, pad_every=None, seed=6)
    whole = random_chunk(paged, TOKENS, 3, seed=7)
    assert_round_trip_matches_reference(paged, slots, range(1, 2), chunk=whole[:, 1:2])


def test_hands_what_it_cannot_move_to_torch() -> None:
    paged = make_cache("flash_nhd", 2, 64, torch.bfloat16, 16)
    slots = make_slots(paged.num_slots, TOKENS, pad_every=None, seed=9)
    # a chunk 2 bytes off the 8-byte words the cache's rows move in
    base = torch.empty(random_chunk(paged, TOKENS, 3, seed=0).numel() + 1, dtype=paged.dtype)
    odd = base[1:].view(paged.chunk_shape(TOKENS, 3))
    assert not numba_rows.copy_rows(paged, slots, odd, range(3), to_chunk=True)
    assert_round_trip_matches_reference(paged, slots, range(3), chunk=odd)
    meta = PagedKV.empty(
        "flash_nhd", num_layers=1, num_blocks=2, block_size=16, num_heads=1, head_size=8,
        dtype=torch.bfloat16, device="meta",
    )  # fmt: skip
    assert numba_rows.row_groups(meta, range(1)) is None  # not a CPU cache


def test_auto_picks_it_on_the_cpu() -> None:
    cpu = torch.device("cpu")
    if "numba" not in registry.backends_for("paged_gather"):
        pytest.skip("numba does not import here")
    assert registry.pick("paged_gather", "auto", cpu) == "numba"
    assert registry.pick("paged_scatter", "auto", cpu) == "numba"


def test_numba_imported_by_kvtier_leaves_every_namespace_walkable() -> None:
    """vLLM's CPU worker start-up calls ``vars(value).get(...)`` on every value of every
    loaded module; llvmlite's library handle answered ``vars()`` with a C function, so a
    second engine in a process where kvtier had imported numba failed to start."""
    code = (
        "import sys, torch\n"
        "from kvtier_kernels import registry\n"
        "assert registry.pick('paged_scatter', 'auto', torch.device('cpu')) == 'numba'\n"
        "for module in list(sys.modules.values()):\n"
        "    for value in list(getattr(module, '__dict__', {}).values()):\n"
        "        if hasattr(value, '__dict__'):\n"
        "            vars(value).get('kernel')\n"
        "import numba\n"
        "assert numba.njit(lambda x: x + 1)(41) == 42  # llvmlite still works\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64])
def test_streaming_stores_write_every_integer_width(dtype) -> None:
    numba = pytest.importorskip("numba")
    intrinsics = streaming_stores()
    stream_store, store_fence = intrinsics["stream_store"], intrinsics["store_fence"]

    @numba.njit
    def copy_reversed(dst, src):
        for i in range(len(src)):
            stream_store(dst, len(src) - 1 - i, src[i])
        store_fence()

    info = np.iinfo(dtype)
    src = np.random.default_rng(3).integers(info.min, info.max, size=67, dtype=dtype)
    dst = np.zeros_like(src)
    copy_reversed(dst, src)
    assert np.array_equal(dst, src[::-1])
    with pytest.raises(numba.core.errors.TypingError):
        copy_reversed(dst, src.astype(np.float64))  # a value of another type is refused


def test_intrinsics_that_do_not_build_send_the_copy_to_torch(monkeypatch, caplog) -> None:
    """A numba whose intrinsics cannot be built (another llvmlite) is a numba that failed:
    one warning, and the copies run the torch backend, bit for bit."""
    monkeypatch.setattr(_launch, "_numba_failures", {})

    def no_intrinsics() -> dict:
        raise AttributeError("module 'llvmlite.ir' has no attribute 'Constant'")

    for to_chunk, op in ((True, "paged_gather"), (False, "paged_scatter")):
        failing = _launch.NumbaKernel(
            numba_rows.paged_rows_kernel, op=op, parallel=False, bindings=no_intrinsics
        )
        monkeypatch.setitem(numba_rows.NUMBA_KERNELS, to_chunk, failing)
    paged = make_cache("flash_nhd", 2, 64, torch.bfloat16, 16)
    slots = make_slots(paged.num_slots, TOKENS, pad_every=3, seed=11)
    with caplog.at_level(logging.WARNING):
        assert_round_trip_matches_reference(paged, slots, range(3))
        assert_round_trip_matches_reference(paged, slots, range(3))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings  # one per op, not one per call
    assert all("has no attribute 'Constant'" in w for w in warnings)
    assert {"paged_gather", "paged_scatter"} == {
        op for op in ("paged_gather", "paged_scatter") for w in warnings if op in w
    }
