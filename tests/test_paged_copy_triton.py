"""Triton paged gather / scatter against the torch reference, bit for bit.

On a machine without a GPU the kernels run in Triton's interpreter (backend
``"interpret"``, CPU tensors) at about a millisecond per program instance, so every shape
here is tiny: a few layers, a few tokens. ``gpu`` tests run the compiled kernels.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import textwrap
from typing import Any

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

from kvtier_kernels import registry
from kvtier_kernels.layouts import LAYOUTS, PagedKV, get_layout
from kvtier_kernels.paged import copy as paged_copy
from kvtier_kernels.paged import rows as paged_rows
from kvtier_kernels.paged.copy import (
    LaunchConfig,
    gather,
    gather_reference,
    gather_torch,
    gather_triton,
    launch_config,
    scatter,
    scatter_reference,
    scatter_triton,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (interpreter or GPU)"
)

NUM_LAYERS = 3
NUM_TOKENS = 7  # tiny: the interpreter costs ~1 ms per program instance

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)

# (layout, num_heads, head_size): every layout, the odd head size 80, MLA's 576.
SHAPES = [(name, 2, 80) for name in sorted(LAYOUTS) if name != "mla"]
SHAPES += [("mla", 1, 576), ("flash_hnd", 3, 64), ("vllm_cpu", 1, 8)]


has_gpu = torch.cuda.is_available()

tl: Any = None  # triton.language, bound by the compat test (importing this file stays light)


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


def make_cache(
    name: str,
    dtype: torch.dtype,
    block_size: int,
    heads: int,
    head_size: int,
    *,
    num_layers: int = NUM_LAYERS,
    separate_layers: bool = False,
    device: str = "cpu",
    seed: int = 0,
) -> PagedKV:
    """A randomly filled cache; ``separate_layers`` allocates each layer on its own."""
    num_blocks = math.ceil(2 * NUM_TOKENS / block_size) + 1
    dims = dict(num_blocks=num_blocks, block_size=block_size, num_heads=heads, head_size=head_size)
    if separate_layers:
        layout = get_layout(name)
        paged = PagedKV(
            layout,
            [layout.empty(**dims, dtype=dtype, device=device) for _ in range(num_layers)],
        )
    else:
        paged = PagedKV.empty(name, num_layers=num_layers, **dims, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(seed)
    for t in paged.tensors:
        t.copy_(fill_random_(torch.empty_like(t, device="cpu"), gen))
    return paged


def random_chunk(
    paged: PagedKV, num_tokens: int, num_layers: int, seed: int, device: str = "cpu"
) -> torch.Tensor:
    out = torch.empty(paged.chunk_shape(num_tokens, num_layers), dtype=paged.dtype)
    return fill_random_(out, torch.Generator().manual_seed(seed)).to(device)


def check_gather(
    paged: PagedKV, slots: torch.Tensor, layers: range, backend: str = "interpret"
) -> None:
    """Gather with ``backend`` and with the reference into equal chunks; compare bits."""
    out = random_chunk(paged, slots.numel(), len(layers), seed=1, device=str(paged.device))
    expected = out.clone()
    gather_reference(paged, slots, expected, layers)
    assert gather(paged, slots, out, layers, backend=backend) is out
    assert_chunk_equal(out, expected, paged, slots, layers)


def check_scatter(
    paged: PagedKV, slots: torch.Tensor, layers: range, backend: str = "interpret"
) -> None:
    """Scatter with ``backend`` and with the reference into equal caches; compare bits."""
    src = random_chunk(paged, slots.numel(), len(layers), seed=2, device=str(paged.device))
    expected = clone_cache(paged)
    scatter_reference(expected, slots, src, layers)
    scatter(paged, slots, src, layers, backend=backend)
    # Whole caches: unnamed slots, padding tokens and unselected layers stay as they were.
    assert_cache_equal(paged, expected)


# ---------------------------------------------------------------------------------------
# interpreter: every layout x dtype x block size, both directions
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "heads", "head_size"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 16])
def test_gather_matches_reference(
    name: str, heads: int, head_size: int, dtype: torch.dtype, block_size: int
) -> None:
    paged = make_cache(name, dtype, block_size, heads, head_size)
    slots = make_slots(paged.num_slots, NUM_TOKENS, pad_every=3, seed=block_size)
    check_gather(paged, slots, range(NUM_LAYERS))


@pytest.mark.parametrize(("name", "heads", "head_size"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 16])
def test_scatter_matches_reference_and_touches_only_named_slots(
    name: str, heads: int, head_size: int, dtype: torch.dtype, block_size: int
) -> None:
    paged = make_cache(name, dtype, block_size, heads, head_size)
    before = clone_cache(paged)
    slots = make_slots(paged.num_slots, NUM_TOKENS, pad_every=3, seed=block_size + 1)
    check_scatter(paged, slots, range(1, NUM_LAYERS))
    # Independently of the reference: padding and unnamed slots, and layer 0, are unchanged.
    named = set(slots[slots >= 0].tolist())
    for layer in range(NUM_LAYERS):
        now, was = bits(paged.layer_view(layer)), bits(before.layer_view(layer))
        for slot in range(paged.num_slots):
            if layer == 0 or slot not in named:
                block, offset = divmod(slot, paged.block_size)
                assert torch.equal(now[:, block, offset], was[:, block, offset]), (layer, slot)


@pytest.mark.parametrize(
    "layers", [range(0, 1), range(1, 3), range(0, 3, 2), range(2, -1, -1)], ids=str
)
@pytest.mark.parametrize("separate_layers", [False, True], ids=["one_buffer", "separate"])
def test_layer_subsets_and_separately_allocated_layers(
    layers: range, separate_layers: bool
) -> None:
    paged = make_cache("vllm_nhd", torch.bfloat16, 4, 2, 80, separate_layers=separate_layers)
    slots = make_slots(paged.num_slots, NUM_TOKENS, pad_every=4, seed=5)
    check_gather(paged, slots, layers)
    check_scatter(paged, slots, layers)


@pytest.mark.parametrize("offset_words", [0, 1], ids=["16-byte aligned", "8-byte aligned"])
def test_the_unaligned_cache_path_is_as_exact_as_the_aligned_one(offset_words: int) -> None:
    """Layers starting 8 bytes off a 16-byte boundary take the kernel's unaligned path
    (no 128-bit hint on the paged side), and move the same bits."""
    like = PagedKV.empty(
        "vllm_nhd",
        num_layers=NUM_LAYERS,
        num_blocks=8,
        block_size=4,
        num_heads=2,
        head_size=64,
        dtype=torch.bfloat16,
    )
    numel = like.tensors[0].numel()
    storage = torch.empty(NUM_LAYERS * numel + 64, dtype=torch.bfloat16)
    start = (-storage.data_ptr() % 16) // 2 + 4 * offset_words  # 4 bf16 = one int64 word
    tensors = [
        storage[start + i * numel : start + (i + 1) * numel].view(like.tensors[0].shape)
        for i in range(NUM_LAYERS)
    ]
    paged = PagedKV(like.layout, tensors)
    for t in paged.tensors:
        fill_random_(t, torch.Generator().manual_seed(3))
    assert paged_rows.layer_table(paged, range(NUM_LAYERS)).alignment == (
        16 if offset_words == 0 else 8
    )
    slots = make_slots(paged.num_slots, NUM_TOKENS, pad_every=5, seed=9)
    check_gather(paged, slots, range(NUM_LAYERS))
    check_scatter(paged, slots, range(NUM_LAYERS))


def test_cross_layer_layout_with_layer_subset() -> None:
    paged = make_cache("cross_layer", torch.float16, 16, 2, 80, num_layers=4)
    slots = make_slots(paged.num_slots, NUM_TOKENS, pad_every=None, seed=6)
    check_gather(paged, slots, range(3, 0, -2))
    check_scatter(paged, slots, range(1, 3))


@pytest.mark.parametrize(
    ("dtype", "head_size"),
    [(torch.float16, 3), (torch.float32, 5), (torch.float8_e4m3fn, 7), (torch.bfloat16, 2)],
    ids=str,
)
def test_narrow_words_for_odd_head_sizes(dtype: torch.dtype, head_size: int) -> None:
    """Rows that no wider word divides are moved as int16 / int32 / int8 words."""
    paged = make_cache("flash_hnd", dtype, 4, 3, head_size)
    slots = make_slots(paged.num_slots, NUM_TOKENS, pad_every=5, seed=7)
    check_gather(paged, slots, range(NUM_LAYERS))
    check_scatter(paged, slots, range(NUM_LAYERS))


def test_misaligned_chunk_view_falls_back_to_narrower_words(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chunk that starts 2 bytes into its buffer cannot be read as int64: int16 it is."""
    words = []

    def spy(op, row_elems, dtype, device):
        words.append(dtype)
        return launch_config(op, row_elems, dtype, device)

    monkeypatch.setattr(paged_copy, "launch_config", spy)
    paged = make_cache("flash_nhd", torch.bfloat16, 4, 2, 8)
    slots = make_slots(paged.num_slots, NUM_TOKENS, pad_every=3, seed=8)
    big = random_chunk(paged, NUM_TOKENS, NUM_LAYERS, seed=9)
    buffer = torch.zeros(big.numel() + 1, dtype=paged.dtype)
    out = buffer[1:].view(big.shape)
    out.copy_(big)
    expected = out.clone()
    gather_reference(paged, slots, expected)
    gather(paged, slots, out, backend="interpret")
    assert_chunk_equal(out, expected, paged, slots, range(NUM_LAYERS))
    aligned = random_chunk(paged, NUM_TOKENS, NUM_LAYERS, seed=9)
    gather(paged, slots, aligned, backend="interpret")
    assert_chunk_equal(aligned, out, paged, slots, range(NUM_LAYERS))
    assert words == [torch.int16, torch.int64]  # the same rows, read as int64 when aligned


def test_int32_slots_and_non_contiguous_chunk() -> None:
    paged = make_cache("flashinfer_hnd", torch.bfloat16, 4, 2, 80)
    slots = make_slots(paged.num_slots, NUM_TOKENS, pad_every=2, seed=10)
    big = random_chunk(paged, NUM_TOKENS + 3, NUM_LAYERS + 1, seed=11)
    out = big[:, 1:, 3:]  # only the last dim is dense
    assert not out.is_contiguous()
    expected = out.clone()
    gather_reference(paged, slots, expected)
    gather(paged, slots.to(torch.int32), out, backend="interpret")
    assert_chunk_equal(out, expected, paged, slots, range(NUM_LAYERS))
    restored = clone_cache(paged)
    scatter(restored, slots.to(torch.int32), out, backend="interpret")
    assert_cache_equal(restored, paged)


def test_all_padding_and_empty_slot_mappings() -> None:
    paged = make_cache("flash_nhd", torch.bfloat16, 16, 2, 80)
    before = clone_cache(paged)
    out = random_chunk(paged, 4, NUM_LAYERS, seed=12)
    untouched = out.clone()
    gather(paged, torch.full((4,), -1), out, backend="interpret")
    assert torch.equal(bits(out), bits(untouched))
    scatter(paged, torch.full((4,), -1), out, backend="interpret")
    scatter(paged, torch.empty(0, dtype=torch.int64), out[:, :, :0], backend="interpret")
    gather(paged, torch.empty(0, dtype=torch.int64), out[:, :, :0], backend="interpret")
    assert_cache_equal(paged, before)


@pytest.mark.parametrize(
    "config",
    [LaunchConfig(2, 16, 1), LaunchConfig(1, 8, 2), LaunchConfig(4, 64, 4)],
    ids=lambda c: f"T{c.block_tokens}_R{c.block_row}_w{c.num_warps}",
)
def test_several_token_tiles_and_row_blocks(
    config: LaunchConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small tiles split tokens and rows over many programs; partial tiles are masked."""
    seen = []

    def fixed_config(op, row_elems, dtype, device):
        seen.append((op, row_elems, dtype))
        return config

    monkeypatch.setattr(paged_copy, "launch_config", fixed_config)
    paged = make_cache("vllm_cpu", torch.bfloat16, 4, 2, 80)  # 40 int64 words per row
    slots = make_slots(paged.num_slots, NUM_TOKENS, pad_every=3, seed=13)
    check_gather(paged, slots, range(NUM_LAYERS))
    check_scatter(paged, slots, range(0, 2))
    assert seen == [("paged_gather", 40, torch.int64), ("paged_scatter", 40, torch.int64)]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(LAYOUTS)),
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(1, 4),
    dtype=st.sampled_from([torch.bfloat16, torch.float8_e4m3fn]),
    data=st.data(),
)
def test_random_slot_mappings_round_trip(
    name: str, block_size: int, num_blocks: int, dtype: torch.dtype, data: st.DataObject
) -> None:
    paged, slot_list = draw_paged_with_slots(data, name, block_size, num_blocks, dtype)
    slots = torch.tensor([*slot_list, -1], dtype=torch.int64)
    check_scatter(paged, slots, range(2))
    check_gather(paged, slots, range(2))


# ---------------------------------------------------------------------------------------
# backends, placement and launch parameters
# ---------------------------------------------------------------------------------------


def test_registry_serves_triton_backends_lazily() -> None:
    # compiled Triton is listed only where it can run: on a GPU
    runnable = (
        ["torch", "triton", "interpret"] if torch.cuda.is_available() else ["torch", "interpret"]
    )
    numba = ["numba"] if "numba" in registry.backends_for("rans_encode") else []
    assert registry.backends_for("paged_gather") == runnable + numba
    assert registry.backends_for("paged_scatter") == runnable + numba
    impl = registry.get("paged_gather", "interpret", "cpu")
    assert impl.func is gather_triton and impl.keywords == {"interpret": True}
    assert registry.get("paged_scatter", "interpret", "cpu").func is scatter_triton
    # auto on a CPU cache: the numba kernel where numba imports, else the torch backend
    auto = registry.get("paged_gather", "auto", "cpu")
    assert auto is (registry.get("paged_gather", "numba") if numba else gather_torch)


def test_launchers_called_directly_pick_the_interpreter_for_cpu_tensors() -> None:
    paged = make_cache("flash_nhd", torch.float16, 4, 2, 8)
    slots = make_slots(paged.num_slots, NUM_TOKENS, pad_every=3, seed=14)
    out = random_chunk(paged, NUM_TOKENS, NUM_LAYERS, seed=15)
    expected = out.clone()
    gather_reference(paged, slots, expected)
    assert gather_triton(paged, slots, out) is out  # interpret=None: by the cache's device
    assert_chunk_equal(out, expected, paged, slots, range(NUM_LAYERS))
    restored = clone_cache(paged)
    scatter_triton(restored, slots, out)
    assert_cache_equal(restored, paged)


def test_backends_refuse_tensors_they_cannot_reach() -> None:
    cpu = make_cache("flash_nhd", torch.float16, 4, 2, 8)
    out = torch.empty(cpu.chunk_shape(2), dtype=cpu.dtype)
    with pytest.raises(ValueError, match="'triton' needs a CUDA/ROCm cache"):
        gather_triton(cpu, torch.arange(2), out, interpret=False)
    meta = PagedKV(cpu.layout, [t.to("meta") for t in cpu.tensors])
    with pytest.raises(ValueError, match="'interpret' runs on CPU tensors; the cache is on meta"):
        gather_triton(meta, torch.arange(2), out, interpret=True)
    with pytest.raises(ValueError, match="'interpret' runs on CPU tensors; src is on meta"):
        scatter_triton(cpu, torch.arange(2), out.to("meta"), interpret=True)


def test_launch_config_hook_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    paged = make_cache("flash_nhd", torch.float16, 4, 2, 8)
    out = torch.empty(paged.chunk_shape(2), dtype=paged.dtype)
    monkeypatch.setattr(paged_copy, "launch_config", lambda *a: LaunchConfig(3, 16, 4))
    with pytest.raises(ValueError, match="block_tokens must be a power of two; got 3"):
        gather(paged, torch.arange(2), out, backend="interpret")
    monkeypatch.setattr(paged_copy, "launch_config", lambda *a: LaunchConfig(1, 16, 32))
    with pytest.raises(ValueError, match="num_warps must be 1, 2, 4, 8 or 16; got 32"):
        gather(paged, torch.arange(2), out, backend="interpret")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8], ids=str)
def test_launch_config_heuristic(device: str, dtype: torch.dtype) -> None:
    for row_elems in (1, 3, 20, 40, 72, 256, 1000, 4096, 65536):
        config = launch_config("paged_gather", row_elems, dtype, torch.device(device))
        for value in (config.block_tokens, config.block_row, config.num_warps):
            assert value >= 1 and value & (value - 1) == 0, config
        assert config.num_warps <= 16
        tile_bytes = config.block_tokens * config.block_row * dtype.itemsize
        assert tile_bytes <= (8192 if device == "cuda" else 1 << 16), config
        if row_elems * dtype.itemsize <= 8192:
            assert config.block_row >= row_elems  # a row that fits takes one program


def test_interpret_backend_works_with_triton_interpret_set_globally() -> None:
    """TRITON_INTERPRET=1 at import (triton's own switch) and our interpreter copies agree."""
    code = textwrap.dedent(
        """
        import torch
        from kvtier_kernels import PagedKV, gather
        from kvtier_kernels.paged import gather_reference
        paged = PagedKV.empty("flash_hnd", num_layers=2, num_blocks=3, block_size=2,
                              num_heads=2, head_size=8, dtype=torch.bfloat16)
        for t in paged.tensors:
            t.view(torch.int16).copy_(torch.randint(-30000, 30000, t.shape))
        slots = torch.tensor([5, -1, 0, 3])
        out = torch.zeros(paged.chunk_shape(4), dtype=torch.bfloat16)
        expected = gather_reference(paged, slots, out.clone())
        gather(paged, slots, out, backend="interpret")
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# ---------------------------------------------------------------------------------------
# _triton_compat: the interpreter without TRITON_INTERPRET, on every supported triton
# ---------------------------------------------------------------------------------------


def _uses_triton_helpers(out, n, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for _ in range(n):  # tensor.__index__: numpy >= 2.4 broke it in triton <= 3.6
        acc += 1
    total = tl.sum(acc, axis=0) + acc.max() + tl.cdiv(n, 2)
    tl.store(out + tl.arange(0, BLOCK), acc + total)


def test_interpreter_scope_runs_triton_library_helpers() -> None:
    """tl.zeros / tl.sum / x.max() / tl.cdiv are @triton.jit helpers and range(n) uses
    tensor.__index__: all fail in a plain InterpretedFunction unless TRITON_INTERPRET was
    set before triton was imported; the compat scope makes them work."""
    from kvtier_kernels import _triton_compat

    global tl
    tl = _triton_compat.language()
    kernel = _triton_compat.jit_interpreted(_uses_triton_helpers)
    out = torch.zeros(8, dtype=torch.int32)
    kernel[(1,)](out, 3, BLOCK=8)
    assert out.tolist() == [3 + 8 * 3 + 3 + 2] * 8


# ---------------------------------------------------------------------------------------
# GPU: the compiled kernels (skipped without a GPU)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "heads", "head_size"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu, reason="needs a CUDA/ROCm GPU")
def test_gpu_matches_reference(
    name: str, heads: int, head_size: int, dtype: torch.dtype, block_size: int
) -> None:
    paged = make_cache(name, dtype, block_size, heads, head_size, device="cuda")
    slots = make_slots(paged.num_slots, NUM_TOKENS, pad_every=3, seed=16).cuda()
    check_gather(paged, slots, range(NUM_LAYERS), backend="triton")
    check_scatter(paged, slots, range(1, NUM_LAYERS), backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu, reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("name", ["flash_nhd", "vllm_nhd", "vllm_cpu", "cross_layer", "mla"])
def test_gpu_cache_with_pinned_host_chunk(name: str) -> None:
    heads, head_size = (1, 576) if name == "mla" else (2, 80)
    paged = make_cache(name, torch.bfloat16, 16, heads, head_size, device="cuda")
    slots = make_slots(paged.num_slots, NUM_TOKENS, pad_every=3, seed=17)
    out = random_chunk(paged, NUM_TOKENS, NUM_LAYERS, seed=18).pin_memory()
    expected = out.clone()
    gather_reference(paged, slots.cuda(), expected)
    gather(paged, slots.cuda(), out, backend="triton")
    torch.cuda.synchronize()
    assert_chunk_equal(out, expected, paged, slots, range(NUM_LAYERS))

    src = random_chunk(paged, NUM_TOKENS, NUM_LAYERS, seed=19).pin_memory()
    want = clone_cache(paged)
    scatter_reference(want, slots.cuda(), src.cuda())
    scatter(paged, slots, src, backend="triton")  # CPU slots are moved to the GPU
    torch.cuda.synchronize()
    assert_cache_equal(paged, want)


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu, reason="needs a CUDA/ROCm GPU")
def test_gpu_refuses_pageable_host_chunk() -> None:
    paged = make_cache("flash_nhd", torch.bfloat16, 16, 2, 8, device="cuda")
    out = torch.empty(paged.chunk_shape(2), dtype=paged.dtype)
    with pytest.raises(ValueError, match="out is in pageable CPU memory"):
        gather(paged, torch.arange(2).cuda(), out, backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu, reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("name", ["vllm_nhd", "flash_hnd", "cross_layer"])
@pytest.mark.parametrize("pinned", [False, True], ids=["device_chunk", "pinned_chunk"])
def test_gpu_realistic_shape(name: str, pinned: bool) -> None:
    """32 layers x 8 heads x 128, bf16, a 256-token chunk with padding, bit-exact."""
    num_tokens, layout = 256, get_layout(name)
    dims = dict(num_blocks=64, block_size=16, num_heads=8, head_size=128)
    paged = PagedKV.empty(layout, num_layers=32, **dims, dtype=torch.bfloat16, device="cuda")
    for t in paged.tensors:
        bits(t).copy_(torch.randint(-(2**15), 2**15, t.shape, device="cuda"))
    slots = make_slots(paged.num_slots, num_tokens, pad_every=17, seed=20).cuda()
    shape = paged.chunk_shape(num_tokens)
    out = torch.zeros(shape, dtype=paged.dtype, pin_memory=True) if pinned else None
    out = out if out is not None else torch.zeros(shape, dtype=paged.dtype, device="cuda")
    expected = torch.zeros(shape, dtype=paged.dtype, device="cuda")
    gather_reference(paged, slots, expected)
    gather(paged, slots, out, backend="triton")
    torch.cuda.synchronize()
    assert_chunk_equal(out, expected, paged, slots.cpu(), range(32))

    want = clone_cache(paged)
    src = torch.empty(shape, dtype=torch.int16, device="cuda").random_().view(paged.dtype)
    src = src.cpu().pin_memory() if pinned else src
    scatter_reference(want, slots, src.cuda())
    scatter(paged, slots, src, backend="triton")
    torch.cuda.synchronize()
    assert_cache_equal(paged, want)
