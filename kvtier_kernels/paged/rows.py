"""Rows of a paged KV cache: how the paged copies (:mod:`kvtier_kernels.paged.copy`) find
them and move them as integer words.

Moving integers is bit-exact for every dtype (fp8 included, NaN payloads kept), and a wider
word moves the same bytes in fewer elements: a bf16 row of 128 values is 32 int64 words.

- :func:`valid_slots`, :func:`read_rows`, :func:`as_words`: the slots to move, the rows at
  them, and the widest integer view of a cache view and chunk rows (the torch reference);
- :func:`copy_whole_blocks`: the torch backend's fast path when the slots are whole
  blocks (as a serving engine hands them out) and the layers are evenly spaced views of
  one buffer (as vLLM allocates them): one strided ``copy_`` per block over every layer,
  one pass over the bytes;
- :func:`copy_head_rows`: the torch backend's path otherwise, one ``index_select`` /
  ``index_copy_`` per KV plane and layer over the cache seen as rows of one head's values;
- :func:`launch_cache`, :func:`layer_table`, :func:`word_view`, :func:`launch_words`: what
  the launchers keep per cache, the per-layer base-address table the Triton kernel reads
  through (built once per cache), and the word type and strides it moves rows in.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvtier_kernels.dtypes import INT_OF_SIZE
from kvtier_kernels.layouts import PagedKV

__all__ = [
    "LayerTable",
    "as_words",
    "copy_head_rows",
    "copy_whole_blocks",
    "launch_cache",
    "launch_words",
    "layer_table",
    "read_rows",
    "torch_backend",
    "valid_slots",
    "word_view",
]


def valid_slots(
    slot_mapping: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Return (token indices of the valid slots, or None when all are valid; valid slots)."""
    slots = slot_mapping.to(device=device, dtype=torch.int64)
    valid = slots >= 0
    if bool(valid.all()):
        return None, slots
    token_index = valid.nonzero().squeeze(1)
    return token_index, slots[token_index]


def read_rows(view: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``[KV, len(slots), H, D]`` copy of the rows at ``slots`` of a canonical view."""
    kv, nb, bs, heads, head_size = view.shape
    s_kv, s_nb, s_bs, s_h, s_d = view.stride()
    blocks_merge = nb == 1 or bs == 1 or s_nb == bs * s_bs
    rows_contiguous = s_d == 1 and (heads == 1 or s_h == head_size)
    if blocks_merge and rows_contiguous:
        # NOTE: index_select over one merged slot dim is several times faster than the
        # two-tensor advanced index below, but only when each slot's H * D row is dense.
        slot_stride = s_bs if bs > 1 else s_nb
        merged = view.as_strided((kv, nb * bs, heads, head_size), (s_kv, slot_stride, s_h, s_d))
        return merged.index_select(1, slots)
    return view[:, slots // bs, slots % bs]


_WORD_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8)


def as_words(
    cache_view: torch.Tensor, chunk_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reinterpret both tensors as the widest integer dtype both strides allow.

    Moving integers is bit-exact for every dtype (fp8 included, NaN payloads kept), and a
    wider word moves the same bytes in fewer elements: a bf16 row of 128 becomes 32 int64.
    """
    for dtype in _WORD_DTYPES:
        if dtype.itemsize < cache_view.element_size():
            break
        try:
            return cache_view.view(dtype), chunk_rows.view(dtype)
        except RuntimeError:  # a stride, size or offset not divisible at this width
            continue
    raise AssertionError(f"no integer view of {cache_view.dtype}")


def _head_row_table(view: torch.Tensor) -> torch.Tensor | None:
    """The storage under a canonical layer view ``[KV, NB, BS, H, D]`` as rows of ``D``
    values (``[rows, D]``), when each head's ``D`` values are contiguous and every other
    stride is a whole number of rows; else None."""
    head_size = view.shape[-1]
    *outer, s_dim = view.stride()
    if s_dim != 1 or any(stride % head_size for stride in outer):
        return None
    elements = view.untyped_storage().nbytes() // view.element_size() - view.storage_offset()
    return view.as_strided((elements // head_size, head_size), (head_size, 1))


def copy_head_rows(
    paged: PagedKV,
    slot_mapping: torch.Tensor,  # [T]; every slot >= 0
    chunk: torch.Tensor,  # [KV, len(layers), T, H * D] on the cache's device
    layers: range,
    to_chunk: bool,
) -> bool:
    """Move every slot's KV between the cache and the chunk as ``H`` head rows per token
    and plane: one ``index_select`` (gather) or ``index_copy_`` (scatter) per plane and
    layer, straight between cache and chunk, one pass over the bytes.

    Returns False, having moved nothing, when the fast path does not apply (a negative
    slot, the chunk on another device or with non-contiguous rows, head rows that are not
    contiguous in the cache); the caller then takes the reference path.
    """
    if chunk.device != paged.device or not len(layers):
        return False
    slots = slot_mapping.to(device=paged.device, dtype=torch.int64)
    if slots.numel() == 0 or bool((slots < 0).any()):
        return False
    head_rows = None
    moves = []
    for j, layer in enumerate(layers):
        view, chunk_rows = as_words(paged.layer_view(layer), chunk[:, j])
        table = _head_row_table(view)
        if table is None or not all(plane.is_contiguous() for plane in chunk_rows):
            return False
        if head_rows is None:  # [KV, T * H] row of (plane, slot, head); the same every layer
            kv, _, bs, heads, head_size = view.shape
            s_kv, s_nb, s_bs, s_h, _ = view.stride()
            token = (slots // bs) * s_nb + (slots % bs) * s_bs
            head_rows = (
                torch.arange(kv, device=slots.device)[:, None, None] * s_kv
                + token[None, :, None]
                + torch.arange(heads, device=slots.device)[None, None, :] * s_h
            ).reshape(kv, -1) // head_size
        moves.append((table, chunk_rows))
    for table, chunk_rows in moves:
        for plane, rows in zip(chunk_rows, head_rows, strict=True):
            plane_rows = plane.view(-1, table.shape[1])  # [T * H, D]: the chunk is row-major
            if to_chunk:
                torch.index_select(table, 0, rows, out=plane_rows)
            else:
                table.index_copy_(0, rows, plane_rows)
    return True


def _whole_blocks(slots: torch.Tensor, block_size: int) -> list[int] | None:
    """The block ids when ``slots`` are whole blocks, each from its offset 0 in order
    (no padding slot); else None."""
    if slots.numel() == 0 or slots.numel() % block_size:
        return None
    runs = slots.view(-1, block_size)
    starts = runs[:, :1]
    offsets = torch.arange(block_size, dtype=slots.dtype, device=slots.device)
    if bool((starts < 0).any()) or bool((starts % block_size).any()):
        return None
    if not torch.equal(runs, starts + offsets):
        return None
    return (starts.squeeze(1) // block_size).tolist()


_layer_steps: OrderedDict[tuple, int | None] = OrderedDict()
_layer_steps_lock = threading.Lock()
_MAX_LAYER_STEPS = 64


def _layer_step(paged: PagedKV, layers: range) -> int | None:
    """Elements between consecutive canonical layer views of ``layers``, when they are
    views of one storage with the same shape and strides, evenly spaced; else None.
    Cached per (addresses, shapes, strides, layers): only integers, never a tensor."""
    key = (
        paged.layout.name,
        tuple((t.data_ptr(), tuple(t.shape), t.stride()) for t in paged.tensors),
        (layers.start, layers.stop, layers.step),
    )
    with _layer_steps_lock:
        if key in _layer_steps:
            _layer_steps.move_to_end(key)
            return _layer_steps[key]
    views = [paged.layer_view(layer) for layer in layers]
    first, offsets = views[0], [v.storage_offset() for v in views]
    step = offsets[1] - offsets[0] if len(views) > 1 else 0
    even = all(
        v.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and v.stride() == first.stride()
        and v.shape == first.shape
        and offset == offsets[0] + i * step
        for i, (v, offset) in enumerate(zip(views, offsets, strict=True))
    )
    with _layer_steps_lock:
        _layer_steps[key] = step if even else None
        while len(_layer_steps) > _MAX_LAYER_STEPS:
            _layer_steps.popitem(last=False)
    return step if even else None


def copy_whole_blocks(
    paged: PagedKV,
    slot_mapping: torch.Tensor,  # [T]; whole blocks, each from offset 0
    chunk: torch.Tensor,  # [KV, len(layers), T, H * D] on the cache's device
    layers: range,
    to_chunk: bool,
) -> bool:
    """Move whole blocks between the cache and the chunk, one pass over the bytes, no
    per-token indexing, over the cache seen as a table of ``[KV, BS, H, D]`` block slices
    (one per layer and block): one ``index_select`` for a gather; for a scatter one
    ``index_copy_`` (a ``copy_`` per slice on a single CPU thread, see the note below);
    one strided ``copy_`` per block over every layer where the layer step is not a whole
    number of blocks.

    Returns False, having moved nothing, when it does not apply (slots that are not whole
    blocks, layers that are not evenly spaced views of one buffer, a chunk on another
    device or not row-major); the caller then takes another path.
    """
    if chunk.device != paged.device or not len(layers):
        return False
    slots = slot_mapping.to(device=paged.device, dtype=torch.int64)
    first = paged.layer_view(layers[0])
    kv, num_blocks, block_size, heads, head_size = first.shape
    blocks = _whole_blocks(slots, block_size)
    step = None if blocks is None else _layer_step(paged, layers)
    if step is None:
        return False
    num_layers = len(layers)
    try:
        per_block = chunk.view(kv, num_layers, len(blocks), block_size, heads, head_size)
        first_words, per_block = as_words(first, per_block)
    except (RuntimeError, AssertionError):  # not row-major, or no common word
        return False
    step_bytes = step * first.element_size()
    if step_bytes % first_words.element_size():
        return False
    step = step_bytes // first_words.element_size()
    s_kv, s_nb, *rest = first_words.stride()
    if s_nb and step % s_nb == 0:
        # the storage as a table of block slices [rows, KV, BS, H, D], row stride s_nb
        extent = sum(
            (n - 1) * st for n, st in zip(first_words.shape, first_words.stride(), strict=True)
        )
        extent -= (num_blocks - 1) * s_nb
        room = first_words.untyped_storage().nbytes() // first_words.element_size()
        rows = (room - first_words.storage_offset() - extent - 1) // s_nb + 1
        table = first_words.as_strided((rows, kv, *first_words.shape[2:]), (s_nb, s_kv, *rest))
        index = torch.tensor(blocks, dtype=torch.int64, device=slots.device)
        index = torch.arange(num_layers, device=slots.device)[:, None] * (step // s_nb) + index
        slices = per_block.view(kv, -1, *per_block.shape[3:]).transpose(0, 1)
        if to_chunk:
            torch.index_select(table, 0, index.flatten(), out=slices)
        elif table.device.type == "cpu" and torch.get_num_threads() == 1:
            # NOTE: index_copy_ of strided slices runs torch's element-wise indexing
            # kernel; on one thread a copy_ per slice (the strided copy kernel) is faster:
            # 33-36 vs 47-49 ms per 128 MiB of 64 KiB slices. With two threads index_copy_
            # is one parallel region and wins: 28 vs 37 ms (quiet 2-core machine).
            for row, block_slice in zip(index.flatten().tolist(), slices, strict=True):
                table[row].copy_(block_slice)
        else:
            table.index_copy_(0, index.flatten(), slices)  # one parallel op (one kernel)
        return True
    stacked = first_words.as_strided(  # [KV, L, NB, BS, H, D]
        (kv, num_layers, *first_words.shape[1:]), (s_kv, step, s_nb, *rest)
    )
    for i, block in enumerate(blocks):
        if to_chunk:
            per_block[:, :, i].copy_(stacked[:, :, block])
        else:
            stacked[:, :, block].copy_(per_block[:, :, i])
    return True


def torch_backend(reference, to_chunk: bool):
    """A paged copy's torch backend: :func:`copy_head_rows` where it applies, else
    ``reference`` (same contract as the reference)."""

    def run(paged: PagedKV, slot_mapping: torch.Tensor, chunk: torch.Tensor, layers=None):
        layers = range(paged.num_layers) if layers is None else layers
        if copy_whole_blocks(paged, slot_mapping, chunk, layers, to_chunk):
            return chunk if to_chunk else None
        if not copy_head_rows(paged, slot_mapping, chunk, layers, to_chunk):
            return reference(paged, slot_mapping, chunk, layers)
        return chunk if to_chunk else None

    return run


_WORD_BYTES = (8, 4, 2, 1)


@dataclass(frozen=True, slots=True)
class LayerTable:
    """The byte address of each selected layer's canonical view, and their alignment."""

    bases: torch.Tensor  # [len(layers)] int64 byte addresses, on the cache's device
    alignment: int  # largest of 16, 8, 4, 2, 1 that divides every address


_OWNER = "tensors"  # launch_cache entry: the tensors (and first address) it was built for


def launch_cache(paged: PagedKV) -> dict:
    """``paged.launch_cache``, emptied first if ``paged.tensors`` is no longer the list (or
    its first tensor no longer at the address) that it was built for: what is cached there
    is never used for other memory."""
    cache = paged.launch_cache
    tensors = paged.tensors
    owner = cache.get(_OWNER)
    if owner is None or owner[0] is not tensors or owner[1] != tensors[0].data_ptr():
        cache.clear()
        cache[_OWNER] = (tensors, tensors[0].data_ptr())
    return cache


def layer_table(paged: PagedKV, layers: range) -> LayerTable:
    """The base-address table of ``layers``, built once per cache (in its
    :func:`launch_cache`, for as long as the cache lives: a kernel in flight may read it).

    Every layer's address is copied to the cache's device once; a run of consecutive
    layers is a view of that table, any other selection a table of its own.
    """
    cache = launch_cache(paged)
    key = ("layer_table", layers.start, layers.stop, layers.step)
    table = cache.get(key)
    if table is not None:
        return table
    every_layer = cache.get("layer_bases")
    if every_layer is None:
        host = paged.layer_base_pointers()
        every_layer = cache["layer_bases"] = (host, host.to(paged.device))
    host, device = every_layer
    selected = host[list(layers)]
    bases = device[layers.start : layers.stop] if layers.step == 1 else selected.to(paged.device)
    alignment = next(w for w in (16, *_WORD_BYTES) if all(b % w == 0 for b in selected.tolist()))
    table = cache[key] = LayerTable(bases, alignment)
    return table


def word_view(
    paged: PagedKV, chunk: torch.Tensor, alignment: int
) -> tuple[torch.Tensor, tuple[int, ...], int]:
    """Pick the widest integer word both sides allow; return (chunk as words, cache
    canonical strides in words, word bytes)."""
    view = paged.layer_view(0)
    itemsize = paged.dtype.itemsize
    # Strides of size-1 dims are never multiplied by a non-zero index: drop them.
    strides = [s if n > 1 else 0 for n, s in zip(view.shape, view.stride(), strict=True)]
    s_dim = strides[4]
    for word_bytes in _WORD_BYTES:
        if word_bytes < itemsize:
            break
        ratio = word_bytes // itemsize
        if word_bytes > alignment or (paged.head_size * itemsize) % word_bytes:
            continue
        if ratio > 1 and s_dim != 1:
            continue
        if any((s * itemsize) % word_bytes for s in strides[:4]):
            continue
        try:
            words = chunk.view(INT_OF_SIZE[word_bytes])
        except RuntimeError:  # a chunk stride or offset not divisible at this width
            continue
        if words.data_ptr() % word_bytes:
            continue
        cache_strides = (
            *(s * itemsize // word_bytes for s in strides[:4]),
            1 if ratio > 1 else s_dim,
        )
        return words, cache_strides, word_bytes
    raise AssertionError(f"no integer word view of {paged.dtype}")


def launch_words(
    paged: PagedKV, chunk: torch.Tensor, layers: range | None = None
) -> tuple[torch.dtype, int]:
    """``(word dtype, words per token row)`` that the Triton launcher moves between
    ``paged`` and ``chunk`` in: what :func:`launch_config` is asked about and the paged
    copies' tuning files are named and keyed by."""
    layers = range(paged.num_layers) if layers is None else layers
    _, _, word_bytes = word_view(paged, chunk, layer_table(paged, layers).alignment)
    return INT_OF_SIZE[
        word_bytes
    ], paged.num_heads * paged.head_size * paged.dtype.itemsize // word_bytes
