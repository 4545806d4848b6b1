"""Paged gather / scatter (torch reference and public launchers) against a per-token loop."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.kv import (
    assert_cache_equal,
    assert_chunk_equal,
    bits,
    clone_cache,
    draw_paged_with_slots,
    fill_random_,
    make_slots,
)

from kvtier_kernels.layouts import LAYOUTS, PagedKV
from kvtier_kernels.paged import copy as paged_copy
from kvtier_kernels.paged import gather, gather_reference, scatter, scatter_reference
from kvtier_kernels.paged.rows import copy_head_rows, copy_whole_blocks

NUM_LAYERS = 3
NUM_TOKENS = 37  # a partial chunk: not a multiple of any block size used here

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES += [torch.float8_e4m3fn, torch.float8_e5m2]

# (layout, num_heads, head_size): odd head sizes included (80; MLA 576).
SHAPES = [(name, 2, 80) for name in sorted(LAYOUTS) if name != "mla"]
SHAPES += [("flash_hnd", 3, 64), ("vllm_cpu", 1, 8), ("mla", 1, 576), ("mla", 1, 80)]


def make_cache(
    name: str, dtype: torch.dtype, block_size: int, heads: int, head_size: int, seed: int = 0
) -> PagedKV:
    num_blocks = math.ceil(2 * NUM_TOKENS / block_size) + 1
    paged = PagedKV.empty(
        name,
        num_layers=NUM_LAYERS,
        num_blocks=num_blocks,
        block_size=block_size,
        num_heads=heads,
        head_size=head_size,
        dtype=dtype,
    )
    gen = torch.Generator().manual_seed(seed)
    for t in paged.tensors:
        fill_random_(t, gen)
    return paged


def loop_gather(paged: PagedKV, slots: torch.Tensor, out: torch.Tensor, layers: range) -> None:
    """Independent slow gather: one token, one plane at a time."""
    for j, layer in enumerate(layers):
        view = bits(paged.layer_view(layer))
        for t, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            block, offset = divmod(slot, paged.block_size)
            for plane in range(paged.kv_planes):
                bits(out)[plane, j, t] = view[plane, block, offset].reshape(-1)


def loop_scatter(paged: PagedKV, slots: torch.Tensor, src: torch.Tensor, layers: range) -> None:
    """Independent slow scatter: one token, one plane at a time."""
    for j, layer in enumerate(layers):
        view = bits(paged.layer_view(layer))
        for t, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            block, offset = divmod(slot, paged.block_size)
            for plane in range(paged.kv_planes):
                view[plane, block, offset] = bits(src)[plane, j, t].view(paged.num_heads, -1)


def empty_chunk(paged: PagedKV, num_tokens: int, num_layers: int, seed: int) -> torch.Tensor:
    out = torch.empty(paged.chunk_shape(num_tokens, num_layers), dtype=paged.dtype)
    return fill_random_(out, torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------
# gather / scatter against the loop, every layout x dtype x block size x head size
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "heads", "head_size"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_gather_matches_loop(
    name: str, heads: int, head_size: int, dtype: torch.dtype, block_size: int
) -> None:
    paged = make_cache(name, dtype, block_size, heads, head_size)
    slots = make_slots(paged.num_slots, NUM_TOKENS, pad_every=5, seed=block_size)
    layers = range(NUM_LAYERS)
    out = empty_chunk(paged, NUM_TOKENS, NUM_LAYERS, seed=1)
    expected = out.clone()
    loop_gather(paged, slots, expected, layers)
    assert gather(paged, slots, out) is out
    assert_chunk_equal(out, expected, paged, slots, layers)


@pytest.mark.parametrize(("name", "heads", "head_size"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 16])
def test_scatter_matches_loop_and_touches_only_named_slots(
    name: str, heads: int, head_size: int, dtype: torch.dtype, block_size: int
) -> None:
    paged = make_cache(name, dtype, block_size, heads, head_size)
    expected = clone_cache(paged)
    slots = make_slots(paged.num_slots, NUM_TOKENS, pad_every=4, seed=block_size + 1)
    layers = range(1, NUM_LAYERS)
    src = empty_chunk(paged, NUM_TOKENS, len(layers), seed=2)
    loop_scatter(expected, slots, src, layers)
    scatter(paged, slots, src, layers)
    # Whole caches compared: unnamed slots, padding tokens and layer 0 stay unchanged.
    assert_cache_equal(paged, expected)


@pytest.mark.parametrize(("name", "heads", "head_size"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_torch_backend_moves_head_rows_bit_exactly(
    name: str, heads: int, head_size: int, dtype: torch.dtype, block_size: int
) -> None:
    """No padding: the torch backend's one-pass head-row path (every layout kvtier knows
    has contiguous head rows) against the loop, both directions, random slots."""
    paged = make_cache(name, dtype, block_size, heads, head_size)
    slots = make_slots(paged.num_slots, NUM_TOKENS, pad_every=None, seed=block_size + 7)
    layers = range(1, NUM_LAYERS)
    out = empty_chunk(paged, NUM_TOKENS, len(layers), seed=12)
    assert copy_head_rows(paged, slots, out, layers, to_chunk=True)
    expected = empty_chunk(paged, NUM_TOKENS, len(layers), seed=13)
    loop_gather(paged, slots, expected, layers)
    assert_chunk_equal(out, expected, paged, slots, layers)
    src = empty_chunk(paged, NUM_TOKENS, len(layers), seed=14)
    want = clone_cache(paged)
    loop_scatter(want, slots, src, layers)
    scatter(paged, slots, src, layers, backend="torch")
    assert_cache_equal(paged, want)  # layer 0 and every unnamed slot unchanged


@pytest.mark.parametrize(("name", "heads", "head_size"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, DTYPES[-1]], ids=str)
@pytest.mark.parametrize(
    ("block_size", "layers"), [(1, range(3)), (4, range(1, 3)), (16, range(2))]
)
@pytest.mark.parametrize("threads", [1, 2])  # one thread: the scatter copies slice by slice
def test_torch_backend_moves_whole_blocks_bit_exactly(
    name: str,
    heads: int,
    head_size: int,
    dtype: torch.dtype,
    block_size: int,
    layers: range,
    threads: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Slots that are whole blocks of a random block table (what a serving engine hands
    out): the block path against the loop, both directions, every layout."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    paged = make_cache(name, dtype, block_size, heads, head_size)
    num_blocks = paged.num_slots // block_size
    blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(block_size))
    slots = (
        blocks[: 32 // block_size or 1, None] * block_size + torch.arange(block_size)
    ).flatten()
    out = empty_chunk(paged, len(slots), len(layers), seed=21)
    assert copy_whole_blocks(paged, slots, out, layers, to_chunk=True)
    expected = empty_chunk(paged, len(slots), len(layers), seed=22)
    loop_gather(paged, slots, expected, layers)
    assert_chunk_equal(out, expected, paged, slots, layers)
    src = empty_chunk(paged, len(slots), len(layers), seed=23)
    want = clone_cache(paged)
    loop_scatter(want, slots, src, layers)
    assert copy_whole_blocks(paged, slots, src, layers, to_chunk=False)
    assert_cache_equal(paged, want)  # other layers and blocks unchanged


def test_whole_block_path_declines_what_it_cannot_do() -> None:
    """Not whole blocks (a partial, a shifted or a padded run) or layers that are separate
    tensors: nothing moved, and gather still gives the loop's result."""
    paged = make_cache("vllm_cpu", torch.bfloat16, 4, 2, 80)
    layers = range(NUM_LAYERS)
    for slots in (torch.arange(8, 14), torch.arange(9, 13), torch.tensor([8, 9, -1, 11])):
        out = empty_chunk(paged, len(slots), NUM_LAYERS, seed=24)
        assert not copy_whole_blocks(paged, slots, out, layers, to_chunk=True)
    separate = PagedKV(paged.layout, [t.clone() for t in paged.tensors])
    slots = torch.arange(8, 16)
    out = empty_chunk(paged, len(slots), NUM_LAYERS, seed=25)
    assert not copy_whole_blocks(separate, slots, out, layers, to_chunk=True)
    gather(separate, slots, out, backend="torch")
    expected = out.clone()
    loop_gather(separate, slots, expected, layers)
    assert_chunk_equal(out, expected, separate, slots, layers)


def test_head_rows_path_declines_what_it_cannot_do() -> None:
    """Padding, or a chunk whose rows are not dense: nothing moved, the reference runs."""
    paged = make_cache("vllm_cpu", torch.bfloat16, 16, 2, 80)
    layers = range(NUM_LAYERS)
    out = empty_chunk(paged, NUM_TOKENS, NUM_LAYERS, seed=15)
    before = out.clone()
    padded = make_slots(paged.num_slots, NUM_TOKENS, pad_every=5, seed=16)
    assert not copy_head_rows(paged, padded, out, layers, to_chunk=True)
    strided = empty_chunk(paged, NUM_TOKENS * 2, NUM_LAYERS, seed=17)[:, :, ::2]
    full = make_slots(paged.num_slots, NUM_TOKENS, pad_every=None, seed=18)
    assert not copy_head_rows(paged, full, strided, layers, to_chunk=True)
    assert torch.equal(bits(out), bits(before))
    expected = strided.clone()
    loop_gather(paged, full, expected, layers)
    gather(paged, full, strided, backend="torch")  # through the reference
    assert_chunk_equal(strided, expected, paged, full, layers)


@pytest.mark.parametrize(("name", "heads", "head_size"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, DTYPES[-1]], ids=str)
def test_round_trip_is_bit_exact(name: str, heads: int, head_size: int, dtype: torch.dtype) -> None:
    paged = make_cache(name, dtype, 16, heads, head_size)
    slots = make_slots(paged.num_slots, NUM_TOKENS, pad_every=3, seed=3)
    src = empty_chunk(paged, NUM_TOKENS, NUM_LAYERS, seed=4)
    scatter(paged, slots, src)
    out = empty_chunk(paged, NUM_TOKENS, NUM_LAYERS, seed=5)
    untouched = out.clone()
    gather(paged, slots, out)
    valid = slots >= 0
    # Selected on integer bits: torch.where has no fp8 kernel.
    expected = torch.where(valid[None, None, :, None], bits(src), bits(untouched)).view(dtype)
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    assert_chunk_equal(out, expected, paged, slots, range(NUM_LAYERS))


@pytest.mark.parametrize("layers", [range(0, 1), range(1, 3), range(0, 3, 2), range(2, -1, -1)])
def test_layer_subsets(layers: range) -> None:
    paged = make_cache("flash_hnd", torch.float16, 16, 2, 80)
    slots = make_slots(paged.num_slots, NUM_TOKENS, pad_every=None, seed=6)
    out = empty_chunk(paged, NUM_TOKENS, len(layers), seed=7)
    expected = out.clone()
    loop_gather(paged, slots, expected, layers)
    gather(paged, slots, out, layers)
    assert_chunk_equal(out, expected, paged, slots, layers)


def test_int32_slots_and_non_contiguous_out() -> None:
    paged = make_cache("vllm_nhd", torch.bfloat16, 16, 2, 80)
    slots = make_slots(paged.num_slots, NUM_TOKENS, pad_every=6, seed=8)
    # A chunk buffer that is a view into a bigger one: only the last dim is dense.
    big = empty_chunk(paged, NUM_TOKENS + 5, NUM_LAYERS + 1, seed=9)
    out = big[:, 1:, 5:]
    assert not out.is_contiguous()
    expected = out.clone()
    loop_gather(paged, slots, expected, range(NUM_LAYERS))
    gather(paged, slots.to(torch.int32), out)
    assert_chunk_equal(out, expected, paged, slots, range(NUM_LAYERS))
    round_trip = clone_cache(paged)
    scatter(round_trip, slots.to(torch.int32), out)
    assert_cache_equal(round_trip, paged)


def test_chunk_rows_are_head_major() -> None:
    """KV_2LTD rows hold head 0's head_size values, then head 1's, ..."""
    paged = PagedKV.empty(
        "flash_nhd",
        num_layers=1,
        num_blocks=2,
        block_size=2,
        num_heads=2,
        head_size=3,
        dtype=torch.float32,
    )
    paged.tensors[0].copy_(torch.arange(48, dtype=torch.float32).view(2, 2, 2, 2, 3))
    out = torch.zeros(paged.chunk_shape(1))
    gather(paged, torch.tensor([3]), out)  # block 1, offset 1
    assert out[0, 0, 0].tolist() == [18.0, 19.0, 20.0, 21.0, 22.0, 23.0]
    assert out[1, 0, 0].tolist() == [42.0, 43.0, 44.0, 45.0, 46.0, 47.0]


def test_all_padding_and_empty_slot_mappings() -> None:
    paged = make_cache("flash_nhd", torch.bfloat16, 16, 2, 80)
    before = clone_cache(paged)
    out = empty_chunk(paged, 4, NUM_LAYERS, seed=10)
    untouched = out.clone()
    gather(paged, torch.full((4,), -1), out)
    assert torch.equal(bits(out), bits(untouched))
    scatter(paged, torch.full((4,), -1), out)
    scatter(paged, torch.empty(0, dtype=torch.int64), out[:, :, :0])
    gather(paged, torch.empty(0, dtype=torch.int64), out[:, :, :0])
    assert_cache_equal(paged, before)


def test_references_accept_default_layers() -> None:
    paged = make_cache("mla", torch.bfloat16, 16, 1, 576)
    slots = make_slots(paged.num_slots, 8, pad_every=None, seed=11)
    out = gather_reference(paged, slots, empty_chunk(paged, 8, NUM_LAYERS, seed=12))
    copy = clone_cache(paged)
    scatter_reference(copy, slots, out)
    assert_cache_equal(copy, paged)


# ---------------------------------------------------------------------------------------
# property test: random slot mappings round trip
# ---------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(LAYOUTS)),
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_blocks=st.integers(1, 6),
    dtype=st.sampled_from([torch.bfloat16, DTYPES[-1]]),
    data=st.data(),
)
def test_random_slot_mappings_round_trip(
    name: str, block_size: int, num_blocks: int, dtype: torch.dtype, data: st.DataObject
) -> None:
    paged, slot_list = draw_paged_with_slots(data, name, block_size, num_blocks, dtype)
    extra_pads = data.draw(st.integers(0, 3), label="extra padding tokens")
    slot_list += [-1] * extra_pads
    slots = torch.tensor(slot_list, dtype=torch.int64)
    num_tokens = len(slot_list)

    before = clone_cache(paged)
    src = empty_chunk(paged, num_tokens, 2, seed=1)
    scatter(paged, slots, src)
    expected_cache = clone_cache(before)
    loop_scatter(expected_cache, slots, src, range(2))
    assert_cache_equal(paged, expected_cache)

    out = empty_chunk(paged, num_tokens, 2, seed=2)
    expected = out.clone()
    loop_gather(paged, slots, expected, range(2))
    gather(paged, slots, out)
    assert_chunk_equal(out, expected, paged, slots, range(2))
    valid = slots >= 0
    assert torch.equal(bits(out)[:, :, valid], bits(src)[:, :, valid])


# ---------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------


@pytest.fixture
def small() -> PagedKV:
    return make_cache("flash_nhd", torch.bfloat16, 4, 2, 8)


def test_wrong_dtype(small: PagedKV) -> None:
    out = torch.empty(small.chunk_shape(3), dtype=torch.float16)
    with pytest.raises(
        ValueError, match=r"out must have the cache dtype torch.bfloat16; got torch.float16"
    ):
        gather(small, torch.arange(3), out)
    with pytest.raises(ValueError, match=r"src must have the cache dtype"):
        scatter(small, torch.arange(3), out)


def test_wrong_shape(small: PagedKV) -> None:
    out = torch.empty(2, NUM_LAYERS, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(
        ValueError, match=r"out must have shape \(2, 3, 3, 16\).*got \(2, 3, 4, 16\)"
    ):
        gather(small, torch.arange(3), out)
    with pytest.raises(ValueError, match=r"src must have shape \(2, 1, 4, 16\)"):
        scatter(small, torch.arange(4), out, range(1))


def test_slot_out_of_range(small: PagedKV) -> None:
    out = torch.empty(small.chunk_shape(3), dtype=small.dtype)
    bad = torch.tensor([0, small.num_slots, 1])
    with pytest.raises(
        ValueError,
        match=rf"slot_mapping\[1\] = {small.num_slots} is out of range: the cache has {small.num_slots} slots",
    ):
        gather(small, bad, out)
    with pytest.raises(ValueError, match="out of range"):
        scatter(small, bad, out)


def test_bad_slot_mapping_layers_and_strides(small: PagedKV) -> None:
    out = torch.empty(small.chunk_shape(3), dtype=small.dtype)
    with pytest.raises(ValueError, match="slot_mapping must be a 1-D int64"):
        gather(small, torch.arange(3, dtype=torch.float32), out)
    with pytest.raises(ValueError, match="slot_mapping must be a 1-D int64"):
        gather(small, torch.arange(3).view(1, 3), out)
    with pytest.raises(
        ValueError, match=r"layers range\(2, 4\) out of range: the cache has 3 layers"
    ):
        gather(small, torch.arange(3), out[:, :2], range(2, 4))
    with pytest.raises(TypeError, match="layers must be a range"):
        gather(small, torch.arange(3), out, [0, 1, 2])  # type: ignore[arg-type]
    strided = torch.empty(*small.chunk_shape(3)[:-1], 2 * small.hidden_dim, dtype=small.dtype)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        gather(small, torch.arange(3), strided[..., ::2])


def test_backend_selection(small: PagedKV) -> None:
    out = torch.empty(small.chunk_shape(3), dtype=small.dtype)
    gather(small, torch.arange(3), out, backend="torch")
    with pytest.raises(ValueError, match="'interpret'"):
        gather(small, torch.arange(3), out, backend="triton")
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'"):
        scatter(small, torch.arange(3), out, backend="cuda")


# ---------------------------------------------------------------------------------------
# Cross-device chunks (speed is measured in perf/, not asserted here)
# ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("name", ["flash_nhd", "vllm_nhd", "cross_layer"])
def test_gpu_cache_with_pinned_host_chunk(name: str) -> None:
    cpu = make_cache(name, torch.bfloat16, 16, 2, 80)
    gpu = PagedKV(cpu.layout, [t.cuda() for t in cpu.tensors])
    slots = make_slots(cpu.num_slots, NUM_TOKENS, pad_every=5, seed=13)
    out = empty_chunk(cpu, NUM_TOKENS, NUM_LAYERS, seed=14).pin_memory()
    expected = out.clone()
    loop_gather(cpu, slots, expected, range(NUM_LAYERS))
    gather(gpu, slots.cuda(), out, backend="torch")
    assert_chunk_equal(out, expected, cpu, slots, range(NUM_LAYERS))
    scatter(gpu, slots, out, backend="torch")
    assert_cache_equal(PagedKV(cpu.layout, [t.cpu() for t in gpu.tensors]), cpu)


def test_module_registers_torch_backend() -> None:
    from kvtier_kernels import registry

    assert registry.get("paged_gather", "torch") is paged_copy.gather_torch
    assert registry.get("paged_scatter", "torch") is paged_copy.scatter_torch
