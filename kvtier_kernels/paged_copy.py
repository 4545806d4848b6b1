"""Paged gather / scatter between an engine's paged KV cache and a ``KV_2LTD`` chunk.

``gather`` reads the KV of ``T`` tokens, one slot each, out of the paged cache into a chunk
buffer; ``scatter`` writes a chunk buffer back into the cache slots::

    cache layer l (canonical view)      [KV, num_blocks, block_size, H, D]
    chunk                               [KV, len(layers), T, H * D]   (KV_2LTD)
    chunk[p, j, t] <-> cache layer layers[j], plane p, block slot[t] // block_size,
                       offset slot[t] % block_size, all heads      (slot[t] >= 0)

A negative slot skips the token: ``gather`` leaves that chunk row untouched and ``scatter``
writes nothing for it. Data movement is bit-exact for every dtype (rows are moved as
same-width integers, so fp8 and NaN payloads pass through unchanged), and any strides the
layout descriptor accepts. Bytes moved per direction:
``KV * len(layers) * T_valid * H * D * itemsize`` read plus the same written.

The chunk buffer may live on another device than the cache (e.g. pinned CPU memory for a
GPU cache); its last dim must be contiguous (stride 1).

Sections: torch reference (the definition of correct) -> Triton kernels (see below) ->
launchers -> registration.
"""

from __future__ import annotations

import torch

from kvtier_kernels import registry
from kvtier_kernels.layouts import PagedKV

__all__ = ["gather", "gather_reference", "scatter", "scatter_reference"]

_WORD_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8)


def _as_words(
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


def _valid_slots(
    slot_mapping: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Return (token indices of the valid slots, or None when all are valid; valid slots)."""
    slots = slot_mapping.to(device=device, dtype=torch.int64)
    valid = slots >= 0
    if bool(valid.all()):
        return None, slots
    token_index = valid.nonzero().squeeze(1)
    return token_index, slots[token_index]


def _read_rows(view: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
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


# ---------------------------------------------------------------------------------------
# torch reference
# ---------------------------------------------------------------------------------------


def gather_reference(
    paged: PagedKV,
    slot_mapping: torch.Tensor,  # [T] int64 (int32 accepted); negative = skip
    out: torch.Tensor,  # [KV, len(layers), T, H * D], same dtype as the cache
    layers: range | None = None,
) -> torch.Tensor:
    """Copy the KV of the slots in ``slot_mapping`` from ``paged`` into ``out``; return ``out``.

    ``out[:, j, t]`` receives layer ``layers[j]`` at ``slot_mapping[t]``; rows with a
    negative slot are left untouched. ``layers`` defaults to every layer. Arguments are
    assumed valid (:func:`gather` validates them).
    """
    layers = range(paged.num_layers) if layers is None else layers
    kv = paged.kv_planes
    token_index, slots = _valid_slots(slot_mapping, paged.device)
    if slots.numel() == 0:
        return out
    if token_index is not None:
        token_index = token_index.to(out.device)
    for j, layer in enumerate(layers):
        view, out_rows = _as_words(
            paged.layer_view(layer), out[:, j]
        )  # [KV,NB,BS,H,Dw], [KV,T,H*Dw]
        rows = _read_rows(view, slots).reshape(kv, -1, out_rows.shape[-1]).to(out.device)
        if token_index is None:
            out_rows.copy_(rows)
        else:
            out_rows.index_copy_(1, token_index, rows)
    return out


def scatter_reference(
    paged: PagedKV,
    slot_mapping: torch.Tensor,  # [T] int64 (int32 accepted); negative = skip
    src: torch.Tensor,  # [KV, len(layers), T, H * D], same dtype as the cache
    layers: range | None = None,
) -> None:
    """Write ``src`` rows into the cache slots in ``slot_mapping`` (inverse of gather).

    Layer ``layers[j]`` at ``slot_mapping[t]`` receives ``src[:, j, t]``; negative slots
    write nothing; every other slot is left unchanged. With duplicate non-negative slots,
    which row lands is unspecified. Arguments are assumed valid (:func:`scatter`
    validates them).
    """
    layers = range(paged.num_layers) if layers is None else layers
    kv = paged.kv_planes
    token_index, slots = _valid_slots(slot_mapping, paged.device)
    if slots.numel() == 0:
        return
    if token_index is not None:
        token_index = token_index.to(src.device)
    blocks, offsets = slots // paged.block_size, slots % paged.block_size
    for j, layer in enumerate(layers):
        view, src_rows = _as_words(
            paged.layer_view(layer), src[:, j]
        )  # [KV,NB,BS,H,Dw], [KV,T,H*Dw]
        if token_index is not None:
            src_rows = src_rows.index_select(1, token_index)
        view[:, blocks, offsets] = src_rows.to(paged.device).reshape(kv, -1, *view.shape[-2:])


# ---------------------------------------------------------------------------------------
# Triton kernels
#
# NOTE: not written yet. The Triton gather/scatter kernels (`_gather_kernel`,
# `_scatter_kernel`, one layer or all layers through `PagedKV.layer_base_pointers()`) go
# here, registered below for the "triton" and "interpret" backends with lazy loaders so
# that importing this module never imports triton. Until then only "torch" is registered
# and `backend="auto"` falls back to it.
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------


def _validate(
    paged: PagedKV,
    slot_mapping: torch.Tensor,
    chunk: torch.Tensor,
    chunk_name: str,
    layers: range | None,
) -> range:
    """Check the arguments of gather/scatter; return the layer range to use."""
    if not isinstance(paged, PagedKV):
        raise TypeError(f"paged must be a PagedKV, got {type(paged).__name__}")
    if layers is None:
        layers = range(paged.num_layers)
    if not isinstance(layers, range):
        raise TypeError(f"layers must be a range or None, got {type(layers).__name__}")
    if len(layers) and not (min(layers) >= 0 and max(layers) < paged.num_layers):
        raise ValueError(f"layers {layers} out of range: the cache has {paged.num_layers} layers")

    if not isinstance(slot_mapping, torch.Tensor):
        raise TypeError(f"slot_mapping must be a torch.Tensor, got {type(slot_mapping).__name__}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"slot_mapping must be a 1-D int64 (or int32) tensor [num_tokens]; "
            f"got shape {tuple(slot_mapping.shape)} dtype {slot_mapping.dtype}"
        )

    expected = paged.chunk_shape(slot_mapping.numel(), len(layers))
    if not isinstance(chunk, torch.Tensor):
        raise TypeError(f"{chunk_name} must be a torch.Tensor, got {type(chunk).__name__}")
    if tuple(chunk.shape) != expected:
        raise ValueError(
            f"{chunk_name} must have shape {expected} [KV, len(layers), num_tokens, "
            f"num_heads * head_size] (KV_2LTD); got {tuple(chunk.shape)}"
        )
    if chunk.dtype != paged.dtype:
        raise ValueError(f"{chunk_name} must have the cache dtype {paged.dtype}; got {chunk.dtype}")
    if chunk.shape[-1] > 1 and chunk.stride(-1) != 1:
        raise ValueError(
            f"{chunk_name} must be contiguous in its last dim (stride 1); got strides {chunk.stride()}"
        )

    if slot_mapping.numel():
        largest = int(slot_mapping.max())
        if largest >= paged.num_slots:
            position = int(slot_mapping.argmax())
            raise ValueError(
                f"slot_mapping[{position}] = {largest} is out of range: the cache has "
                f"{paged.num_slots} slots (num_blocks={paged.num_blocks} x "
                f"block_size={paged.block_size})"
            )
    return layers


def gather(
    paged: PagedKV,
    slot_mapping: torch.Tensor,  # [T] int64 (int32 accepted); negative = skip
    out: torch.Tensor,  # [KV, len(layers), T, H * D]
    layers: range | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Gather the KV of ``slot_mapping`` from ``paged`` into the ``KV_2LTD`` chunk ``out``.

    Args:
        paged: the engine cache.
        slot_mapping: ``slot = block_id * block_size + offset`` per token; negative skips
            the token (its ``out`` row is left untouched).
        out: chunk buffer ``paged.chunk_shape(T, len(layers))``, the cache's dtype, last
            dim contiguous; may be on another device than the cache.
        layers: engine layers mapped to ``out``'s layer dim (default: all).
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"interpret"`` (see registry).

    Returns:
        ``out``.

    Raises:
        TypeError / ValueError: a wrong argument type, shape, dtype or stride, a layer out
            of range, or a slot ``>= paged.num_slots`` (names the slot and the slot count).

    NOTE: validating the slot range reads ``slot_mapping.max()``, a device sync when the
    slots live on a GPU.
    """
    layers = _validate(paged, slot_mapping, out, "out", layers)
    impl = registry.get("paged_gather", backend, paged.device)
    return impl(paged, slot_mapping, out, layers)


def scatter(
    paged: PagedKV,
    slot_mapping: torch.Tensor,  # [T] int64 (int32 accepted); negative = skip
    src: torch.Tensor,  # [KV, len(layers), T, H * D]
    layers: range | None = None,
    *,
    backend: str = "auto",
) -> None:
    """Scatter the ``KV_2LTD`` chunk ``src`` into the slots of ``slot_mapping`` in ``paged``.

    Same arguments and errors as :func:`gather`, with ``src`` in place of ``out``; negative
    slots write nothing and every slot not named is left unchanged.
    """
    layers = _validate(paged, slot_mapping, src, "src", layers)
    impl = registry.get("paged_scatter", backend, paged.device)
    impl(paged, slot_mapping, src, layers)


# ---------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------

registry.register("paged_gather", "torch", gather_reference)
registry.register("paged_scatter", "torch", scatter_reference)
