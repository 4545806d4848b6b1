"""Helpers shared by the paged-copy tests (torch reference and Triton kernels).

The assertion helpers compare bit patterns (fp8 and NaN payloads included) of tensors on
any device and, on a mismatch, name where it is: layer, K/V plane, token, slot, block, head.
"""

from __future__ import annotations

import torch

from kvtier_kernels.dtypes import bits
from kvtier_kernels.dtypes import fill_random_bits_ as fill_random_
from kvtier_kernels.layouts import PagedKV


def clone_cache(paged: PagedKV) -> PagedKV:
    """An independent copy with the same layout and strides."""
    return PagedKV(paged.layout, [t.clone() for t in paged.tensors])


def make_slots(num_slots: int, num_tokens: int, pad_every: int | None, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    if pad_every:
        slots[::pad_every] = -1
    return slots


def assert_chunk_equal(
    actual: torch.Tensor, expected: torch.Tensor, paged: PagedKV, slots: torch.Tensor, layers: range
) -> None:
    """Bit-compare two KV_2LTD chunks; on mismatch name (layer, plane, token, slot, block, head)."""
    actual, expected = actual.cpu(), expected.cpu()
    diff = bits(actual) != bits(expected)
    if not diff.any():
        return
    plane, j, token, col = (int(i) for i in diff.nonzero()[0])
    slot = int(slots[token])
    block, offset = divmod(slot, paged.block_size) if slot >= 0 else (None, None)
    raise AssertionError(
        f"chunk mismatch at layer {layers[j]} (chunk index {j}), kv plane {plane}, token {token}, "
        f"slot {slot} (block {block}, offset {offset}), head {col // paged.head_size}, "
        f"dim {col % paged.head_size}: got {actual[plane, j, token, col]!r}, "
        f"expected {expected[plane, j, token, col]!r}; {int(diff.sum())} elements differ"
    )


def assert_cache_equal(actual: PagedKV, expected: PagedKV) -> None:
    """Bit-compare two caches; on mismatch name (layer, plane, slot, block, head)."""
    for layer in range(actual.num_layers):
        got, want = actual.layer_view(layer).cpu(), expected.layer_view(layer).cpu()
        diff = bits(got) != bits(want)
        if diff.any():
            plane, block, offset, head, dim = (int(i) for i in diff.nonzero()[0])
            raise AssertionError(
                f"cache mismatch at layer {layer}, kv plane {plane}, "
                f"slot {block * actual.block_size + offset} (block {block}, offset {offset}), "
                f"head {head}, dim {dim}; {int(diff.sum())} elements differ in this layer"
            )


def draw_paged_with_slots(
    data, name: str, block_size: int, num_blocks: int, dtype: torch.dtype
) -> tuple[PagedKV, list[int]]:
    """For hypothesis tests: a 2-layer cache of layout ``name`` filled with random bits,
    and a slot list drawn from ``data`` (distinct slots, some replaced by padding -1)."""
    from hypothesis import strategies as st

    heads, head_size = (1, 12) if name == "mla" else (2, 6)
    paged = PagedKV.empty(
        name,
        num_layers=2,
        num_blocks=num_blocks,
        block_size=block_size,
        num_heads=heads,
        head_size=head_size,
        dtype=dtype,
    )
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    for t in paged.tensors:
        fill_random_(t, gen)
    num_slots = paged.num_slots
    unique = data.draw(st.lists(st.integers(0, num_slots - 1), unique=True, max_size=num_slots))
    padding = data.draw(st.lists(st.booleans(), min_size=len(unique), max_size=len(unique)))
    return paged, [-1 if pad else s for s, pad in zip(unique, padding, strict=True)]
