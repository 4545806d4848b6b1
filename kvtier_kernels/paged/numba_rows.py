"""The paged copies' numba backend: head rows moved between a CPU cache and a CPU chunk by
one compiled loop.

torch's indexing kernels move a row of ``D`` values element by element, and on a scatter
into vLLM's CPU layout (``index_copy_`` of 256-byte rows) that ran at a fifth of a plain
copy. This backend moves each row as a run of integer words (the widest every address,
stride and the row allow: bit-exact for every dtype) in a serial numba kernel, layer by
layer; for each (token, head) the row of every plane::

    layer g of a storage group, token t, head h, plane p, word w < row_words
      cache  storage[layer_base[g] + row_offsets[p, t * H + h] + w]
      chunk  chunk[p * c_plane + layer_pos[g] * c_layer + t * c_token + h * row_words + w]

``row_offsets`` is -1 for a token whose slot is negative (nothing moved). Layers are
grouped by the storage they live in (vLLM's layers are views of one buffer: one group);
each group is one numpy view of its whole storage, so the kernel never sees a raw address.
Slots are range-checked before the kernel runs (the plan's ``TorchCopy``), as for torch.

The kernel reads its source in the order it lies in (a scatter the chunk token by token;
a gather from head-major blocks, as vLLM's CPU layout's, a block of tokens at a time, head
by head and plane by plane) and writes with streaming stores
(:mod:`kvtier_kernels._numba_stores`): no destination line is read before it is written.
On this project's 2-core machine, against a raw copy of the same 128 MiB timed in
alternation, a prompt's scatter into vLLM's CPU layout went from 0.55x to 0.90-0.95x
(20-21 GB/s) and a gather of it from 0.40x to 0.68x.

The kernel is serial (:class:`~kvtier_kernels._launch.NumbaKernel` with
``parallel=False``: a serving engine's own thread calls it, and numba's threading layers
must stay out of that thread), and it runs on the caller's thread alone. NOTE: split over
a second Python thread (the kernel releases the GIL) it ran faster alone, but slower in
an engine: right after a torch op the OpenMP threads of torch (vLLM's CPU forward pass
uses them) spin-wait on the cores, and the second thread competed with them (retrieve of
a prompt at 0.79-0.81x a raw copy split, 0.84x on one thread; a store 0.57-0.59x split;
this project's 2-core machine). Where this backend does not apply (a chunk or cache not on the CPU, a chunk
whose rows are not contiguous, head rows that are not contiguous in the cache, no integer
word both sides allow) the call runs the torch backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier_kernels._launch import NumbaKernel
from kvtier_kernels._numba_stores import streaming_stores
from kvtier_kernels.dtypes import INT_OF_SIZE
from kvtier_kernels.layouts import PagedKV
from kvtier_kernels.paged.rows import copy_whole_blocks, launch_cache

__all__ = ["NUMBA_KERNELS", "RowGroups", "copy_rows", "numba_backend", "row_groups"]


stream_store: Any = None  # bound to the intrinsics of kvtier_kernels._numba_stores by
store_fence: Any = None  # NumbaKernel.get(), so that importing this module never imports numba


def move_row(src, src_at, dst, dst_at, words):
    """``dst[dst_at : dst_at + words] = src[src_at : src_at + words]``, written with
    streaming stores."""
    # NOTE: a loop over a slice (indices known non-negative) compiles to vector loads;
    # indexing the whole array does not
    row = src[src_at : src_at + words]
    for w in range(words):
        stream_store(dst, dst_at + w, row[w])


def paged_rows_kernel(
    storage, layer_base, layer_pos, row_offsets, chunk, chunk_strides, heads, row_words,
    to_chunk, start, stop, group,
):  # fmt: skip
    """Move the rows of layers ``[start, stop)`` of one storage group (see the module
    docstring), reading in the order their source lies in: a gather with ``group`` > 0
    (a cache whose blocks are head-major) reads ``group`` tokens (a block's worth) at a
    time, head by head and plane by plane, where vLLM's CPU layout keeps them next to each
    other; otherwise the rows go token by token, for each head the row of every plane."""
    planes = row_offsets.shape[0]
    tokens = row_offsets.shape[1] // heads
    c_plane, c_layer, c_token = chunk_strides[0], chunk_strides[1], chunk_strides[2]
    for g in range(start, stop):
        base, chunk_layer = layer_base[g], layer_pos[g] * c_layer
        if to_chunk and group > 0:
            for first in range(0, tokens, group):
                for h in range(heads):
                    for p in range(planes):
                        for t in range(first, min(first + group, tokens)):
                            if row_offsets[0, t * heads] >= 0:  # a negative slot: nothing
                                cache_at = base + row_offsets[p, t * heads + h]
                                chunk_at = chunk_layer + t * c_token + p * c_plane
                                move_row(storage, cache_at, chunk, chunk_at + h * row_words,
                                         row_words)  # fmt: skip
            continue
        for t in range(tokens):
            if row_offsets[0, t * heads] < 0:
                continue
            chunk_token = chunk_layer + t * c_token
            for h in range(heads):
                for p in range(planes):
                    cache_at = base + row_offsets[p, t * heads + h]
                    chunk_at = chunk_token + p * c_plane + h * row_words
                    if to_chunk:
                        move_row(storage, cache_at, chunk, chunk_at, row_words)
                    else:
                        move_row(chunk, chunk_at, storage, cache_at, row_words)
    store_fence()  # the streaming stores are visible to every thread from here


# one per op, so that a failed compile sends that op's ``auto`` to torch (the registry)
NUMBA_KERNELS = {
    to_chunk: NumbaKernel(
        paged_rows_kernel, [move_row], op=op, parallel=False, bindings=streaming_stores
    )
    for op, to_chunk in (("paged_gather", True), ("paged_scatter", False))
}


@dataclass(frozen=True, slots=True)
class RowGroups:
    """What the kernel needs of one cache and layer selection, built once per cache."""

    word: torch.dtype  # the integer word rows move in
    row_words: int  # words of one head row (D values)
    strides: tuple[int, int, int, int]  # canonical (plane, block, slot, head) strides, words
    groups: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]  # (storage, bases, pos)


def _word_of(paged: PagedKV, layers: range) -> torch.dtype | None:
    """The widest integer word (8 bytes down to the element size) that divides every
    selected layer's address and its storage's, every canonical stride and the head row;
    None where the head's values are not contiguous."""
    view = paged.layer_view(layers[0])
    itemsize = view.element_size()
    if view.stride(4) != 1 and view.shape[4] > 1:
        return None
    strides = [
        s * itemsize for s, n in zip(view.stride()[:4], view.shape[:4], strict=True) if n > 1
    ]
    views = [paged.layer_view(layer) for layer in layers]
    offsets = [v.data_ptr() for v in views] + [v.untyped_storage().data_ptr() for v in views]
    for word_bytes in (8, 4, 2, 1):
        if word_bytes < itemsize:
            return None
        sizes = [*strides, *offsets, view.shape[4] * itemsize]
        if all(size % word_bytes == 0 for size in sizes):
            return INT_OF_SIZE[word_bytes]
    return None


def row_groups(paged: PagedKV, layers: range) -> RowGroups | None:
    """The kernel's view of ``layers`` of ``paged`` (cached in its launch cache), or None
    where this backend does not apply to the cache."""
    cache = launch_cache(paged)
    key = ("numba_rows", layers.start, layers.stop, layers.step)
    if key in cache:
        return cache[key]
    word = _word_of(paged, layers) if paged.device.type == "cpu" and len(layers) else None
    groups: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
    if word is not None:
        word_bytes = word.itemsize
        for pos, layer in enumerate(layers):
            view = paged.layer_view(layer)
            storage = view.untyped_storage()
            entry = groups.get(storage.data_ptr())
            if entry is None:
                whole = torch.empty(0, dtype=word).set_(
                    storage, 0, (storage.nbytes() // word_bytes,)
                )
                entry = groups[storage.data_ptr()] = (whole, [], [])
            entry[1].append((view.data_ptr() - storage.data_ptr()) // word_bytes)
            entry[2].append(pos)
    if word is None:
        cache[key] = None
        return None
    view = paged.layer_view(layers[0])
    itemsize, word_bytes = view.element_size(), word.itemsize
    strides = tuple(
        s * itemsize // word_bytes if n > 1 else 0
        for s, n in zip(view.stride()[:4], view.shape[:4], strict=True)
    )
    cache[key] = RowGroups(
        word,
        view.shape[4] * itemsize // word_bytes,
        strides,
        tuple(
            (whole.numpy(), np.array(bases, dtype=np.int64), np.array(pos, dtype=np.int64))
            for whole, bases, pos in groups.values()
        ),
    )
    return cache[key]


def _row_offsets(paged: PagedKV, slots: torch.Tensor, rows: RowGroups) -> np.ndarray:
    """``[KV, T * H]`` word offset of each (plane, token, head) row within a layer, -1 for a
    token whose slot is negative."""
    s_plane, s_block, s_slot, s_head = rows.strides
    kv, heads, block_size = paged.kv_planes, paged.num_heads, paged.block_size
    slots = slots.to(torch.int64)
    token = (slots // block_size) * s_block + (slots % block_size) * s_slot
    offsets = (
        torch.arange(kv)[:, None, None] * s_plane
        + token[None, :, None]
        + torch.arange(heads)[None, None, :] * s_head
    )
    offsets = torch.where((slots < 0)[None, :, None], -1, offsets)
    return offsets.reshape(kv, -1).numpy()


def copy_rows(
    paged: PagedKV,
    slot_mapping: torch.Tensor,
    chunk: torch.Tensor,
    layers: range,
    to_chunk: bool,
) -> bool:
    """Move ``slot_mapping``'s rows of ``layers`` between ``paged`` and ``chunk`` (a
    ``KV_2LTD`` chunk); False, having moved nothing, where this backend does not apply.

    Raises:
        NumbaUnavailable: numba failed to import or to compile the kernel (before any
            byte was moved).
    """
    if chunk.device.type != "cpu" or slot_mapping.numel() == 0:
        return False
    rows = row_groups(paged, layers)
    if rows is None:
        return False
    try:
        words = chunk.view(rows.word)
    except RuntimeError:  # a chunk stride or offset not divisible at this width
        return False
    row_words, heads = rows.row_words, paged.num_heads
    if words.stride(3) != 1 or words.data_ptr() % rows.word.itemsize:
        return False
    span = sum((n - 1) * s for n, s in zip(words.shape, words.stride(), strict=True)) + 1
    flat = words.as_strided((span,), (1,)).numpy()
    chunk_strides = np.array(words.stride()[:3], dtype=np.int64)
    offsets = _row_offsets(paged, slot_mapping, rows)
    _, _, s_slot, s_head = rows.strides
    # a gather reads a head-major block (vLLM's CPU layout, HND) head by head
    group = paged.block_size if to_chunk and s_head > s_slot else 0
    kernel = NUMBA_KERNELS[to_chunk]
    for storage, bases, positions in rows.groups:
        args = (storage, bases, positions, offsets, flat, chunk_strides, heads, row_words, to_chunk)
        kernel(*args, 0, len(bases), group, work=len(bases))
    return True


def numba_backend(torch_impl: Callable, to_chunk: bool) -> Callable:
    """A paged copy's numba backend: :func:`copy_rows` where it applies, else
    ``torch_impl`` (the torch backend, same contract). A gather of whole blocks of
    evenly spaced layers is left to torch's one ``index_select`` of block slices
    (:func:`~kvtier_kernels.paged.rows.copy_whole_blocks`): a prompt's store from vLLM's
    CPU layout ran at 0.62x a raw copy there against 0.53-0.60x with this kernel (the two
    copies alone: 0.66-0.69x each); a scatter always runs here (a prompt's retrieve:
    torch's ``index_copy_`` of the same slices 0.32x, this kernel 0.82-0.90x; 2-core
    machine)."""

    @NUMBA_KERNELS[to_chunk].falling_back_to(torch_impl)
    def run(paged: PagedKV, slot_mapping: torch.Tensor, chunk: torch.Tensor, layers=None):
        layers = range(paged.num_layers) if layers is None else layers
        if to_chunk and copy_whole_blocks(paged, slot_mapping, chunk, layers, to_chunk=True):
            return chunk
        if not copy_rows(paged, slot_mapping, chunk, layers, to_chunk):
            return torch_impl(paged, slot_mapping, chunk, layers)
        return chunk if to_chunk else None

    return run
