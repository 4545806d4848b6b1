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

Backends (see :mod:`kvtier_kernels.registry`): ``torch`` moves head rows with one
``index_select``/``index_copy_`` per plane and layer where it can, else the reference;
``triton`` runs ``paged_copy_kernel`` compiled (one kernel, ``TO_CHUNK`` picks the
direction), on CUDA/ROCm caches, with the chunk on the same GPU or in pinned host memory
(read or written over the bus);
``interpret`` runs the same kernel under Triton's interpreter on CPU tensors. One launch
covers every selected layer: grid ``(token tiles x row blocks, len(layers), KV)``, each
program moving a ``BLOCK_T x BLOCK_R`` tile of integer words (see "Triton kernel").

Sections: torch reference (the definition of correct) -> Triton kernel -> launchers
(public, then Triton) -> registration.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from kvtier_kernels import registry
from kvtier_kernels._launch import (
    LazyKernel,
    check_launch_config,
    next_power_of_2,
    triton_loader,
)
from kvtier_kernels.dtypes import INT_OF_SIZE
from kvtier_kernels.layouts import PagedKV
from kvtier_kernels.paged.rows import (
    as_words,
    layer_table,
    read_rows,
    torch_backend,
    valid_slots,
    word_view,
)
from kvtier_kernels.tuning.files import Tunable, register_tunable
from kvtier_kernels.tuning.lookup import tuned_config

__all__ = [
    "KERNEL",
    "LaunchConfig",
    "gather",
    "gather_reference",
    "gather_torch",
    "gather_triton",
    "launch_config",
    "paged_copy_kernel",
    "scatter",
    "scatter_reference",
    "scatter_torch",
    "scatter_triton",
]


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
    token_index, slots = valid_slots(slot_mapping, paged.device)
    if slots.numel() == 0:
        return out
    if token_index is not None:
        token_index = token_index.to(out.device)
    for j, layer in enumerate(layers):
        view, out_rows = as_words(
            paged.layer_view(layer), out[:, j]
        )  # [KV,NB,BS,H,Dw], [KV,T,H*Dw]
        rows = read_rows(view, slots).reshape(kv, -1, out_rows.shape[-1]).to(out.device)
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
    token_index, slots = valid_slots(slot_mapping, paged.device)
    if slots.numel() == 0:
        return
    if token_index is not None:
        token_index = token_index.to(src.device)
    blocks, offsets = slots // paged.block_size, slots % paged.block_size
    for j, layer in enumerate(layers):
        view, src_rows = as_words(
            paged.layer_view(layer), src[:, j]
        )  # [KV,NB,BS,H,Dw], [KV,T,H*Dw]
        if token_index is not None:
            src_rows = src_rows.index_select(1, token_index)
        view[:, blocks, offsets] = src_rows.to(paged.device).reshape(kv, -1, *view.shape[-2:])


# ---------------------------------------------------------------------------------------
# Triton kernel
#
# Grid: (token tiles x row blocks, len(layers), KV). Program (p0, j, plane) moves the tile
# chunk[plane, j, tile * BLOCK_T : +BLOCK_T, row_block * BLOCK_R : +BLOCK_R] (in words) to or
# from cache layer layers[j], plane `plane`. A row is the H * D values of one token, moved as
# `row_words` integer words (int8..int64, the widest that every stride, the head size and
# every base address allow); head h, word d of a row sits at h * s_head + d * s_dim in the
# cache and at h * head_words + d in the chunk. The constexpr TO_CHUNK picks the direction
# (gather: cache -> chunk; scatter: chunk -> cache); the addressing is the same both ways.
#
# `layer_bases` is an int64 table of the byte address of each selected layer's canonical
# view (`PagedKV.layer_base_pointers()`), cast in the kernel to a pointer to the word type:
# one launch covers every layer whether the layers are views of one buffer (vLLM) or
# separate allocations. The interpreter follows those raw addresses too (CPU tensors).
#
# NOTE: `tl` is bound to `triton.language` by `LazyKernel.get()` on first use, so that importing
# this module never imports triton. The kernel calls only Triton builtins.
# ---------------------------------------------------------------------------------------

tl: Any = None


def paged_copy_kernel(
    layer_bases,  # [len(layers)] int64: byte address of each layer's canonical view
    slot_mapping,  # [T] int64 or int32; negative = skip
    chunk,  # [KV, len(layers), T, row_words] integer words, last dim dense
    s_kv,  # cache canonical strides, in words
    s_block,
    s_slot,
    s_head,
    s_dim,
    c_kv,  # chunk strides, in words
    c_layer,
    c_token,
    num_tokens,
    block_size,
    head_words,
    row_words,
    row_blocks,
    TO_CHUNK: tl.constexpr,  # True: cache -> chunk (gather); False: chunk -> cache (scatter)
    ALIGNED: tl.constexpr,  # every layer base is 16-byte aligned: 128-bit cache accesses
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    tile_and_row_block = tl.program_id(0)
    j = tl.program_id(1)
    plane = tl.program_id(2).to(tl.int64)
    tile = tile_and_row_block // row_blocks
    row_block = tile_and_row_block - tile * row_blocks

    tokens = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.load(slot_mapping + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    cols = row_block * BLOCK_R + tl.arange(0, BLOCK_R)
    # A per-token condition ANDed as a column, not folded into the bound: a bound taken
    # through tl.where loses its divisibility and with it every vector access.
    mask = (cols[None, :] < row_words) & (slots >= 0)[:, None]

    slots = tl.maximum(slots, 0)
    blocks = slots // block_size
    offsets = slots - blocks * block_size
    heads = cols // head_words
    dims = cols - heads * head_words
    cache_rows = plane * s_kv + blocks * s_block + offsets * s_slot
    cache_cols = heads.to(tl.int64) * s_head + dims.to(tl.int64) * s_dim
    chunk_rows = plane * c_kv + j.to(tl.int64) * c_layer + tokens.to(tl.int64) * c_token

    cache = tl.load(layer_bases + j).to(tl.pointer_type(chunk.dtype.element_ty))
    if ALIGNED:
        # NOTE: a base read from a table carries no alignment the compiler can see; without
        # this hint every cache access is one word wide. The launcher checks the addresses.
        cache = tl.multiple_of(cache, 16)
    cache_ptrs = cache + cache_rows[:, None] + cache_cols[None, :]
    chunk_ptrs = chunk + chunk_rows[:, None] + cols[None, :]
    if TO_CHUNK:
        tl.store(chunk_ptrs, tl.load(cache_ptrs, mask=mask), mask=mask)
    else:
        tl.store(cache_ptrs, tl.load(chunk_ptrs, mask=mask), mask=mask)


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
# Triton launchers
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Launch parameters of one paged-copy kernel launch.

    Attributes:
        block_tokens: tokens per program (``BLOCK_T``), a power of two.
        block_row: row words per program (``BLOCK_R``), a power of two; rows longer than
            this are split over several programs.
        num_warps: warps per program, one of 1, 2, 4, 8, 16.
    """

    block_tokens: int
    block_row: int
    num_warps: int


# launch_config(op, row_words, word_dtype, device): a row of words is all it sees.
for _op in ("paged_gather", "paged_scatter"):
    register_tunable(Tunable(_op, ("row_words",), None, ("block_tokens", "block_row", "num_warps")))

_GPU_TILE_BYTES = 8192  # bytes per program on a GPU: 256 threads x 32 B at 8 warps
_INTERPRETER_TILE_BYTES = 1 << 16  # the interpreter pays ~1 ms per program: fewer, bigger ones


def launch_config(
    op: str, row_elems: int, dtype: torch.dtype, device: torch.device, *, tuned: bool = True
) -> LaunchConfig:
    """Launch parameters for ``op`` moving rows of ``row_elems`` elements of ``dtype``.

    The launchers call it with the row in *words*: ``row_elems`` is the number of integer
    words per token row and ``dtype`` the word type (``torch.int64`` for a bf16 row of
    128 x 8 heads: 256 words). ``op`` is ``"paged_gather"`` or ``"paged_scatter"``;
    ``device`` is the cache's device (CPU means the interpreter).

    A per-device tuning file written by ``kvtier tune`` wins when it has an entry for this
    row length (:func:`kvtier_kernels.tuning.lookup.tuned_config`: files named by op,
    backend, device and word type). Otherwise (and always with ``tuned=False``, what the
    tuner compares against) the built-in heuristic gives each program one tile of about
    8 KiB (a whole row when it fits, several tokens when rows are short), with one warp per
    KiB; under the interpreter, where each program costs about a millisecond, tiles of up
    to 64 KiB.
    """
    key = {"row_words": row_elems}
    found = tuned_config(op, device, dtype, key) if tuned else None
    if found is not None:
        return LaunchConfig(**found)
    itemsize = dtype.itemsize
    tile_bytes = _GPU_TILE_BYTES if device.type == "cuda" else _INTERPRETER_TILE_BYTES
    block_row = min(next_power_of_2(row_elems), max(1, tile_bytes // itemsize))
    block_tokens = max(1, min(64, tile_bytes // (block_row * itemsize)))
    num_warps = max(1, min(8, block_tokens * block_row * itemsize // 1024))
    return LaunchConfig(block_tokens, block_row, next_power_of_2(num_warps))


KERNEL = LazyKernel(paged_copy_kernel)
"""The one kernel of both directions, decorated (compiled or interpreted) on first use."""


def _check_placement(paged: PagedKV, chunk: torch.Tensor, chunk_name: str, interpret: bool) -> None:
    """Raise ValueError when the kernel could not reach the cache or the chunk."""
    if interpret:
        for name, device in (("the cache", paged.device), (chunk_name, chunk.device)):
            if device.type != "cpu":
                raise ValueError(
                    f"kernel backend 'interpret' runs on CPU tensors; {name} is on {device} "
                    "(use 'triton' for GPU tensors)"
                )
        return
    if paged.device.type != "cuda":
        raise ValueError(
            f"kernel backend 'triton' needs a CUDA/ROCm cache; the cache is on {paged.device} "
            "(use 'interpret' or 'torch')"
        )
    if chunk.device.type == "cpu":
        if not chunk.is_pinned():
            raise ValueError(
                f"{chunk_name} is in pageable CPU memory, which a GPU kernel cannot reach: "
                "allocate it with pin_memory=True, or use backend 'torch'"
            )
    elif chunk.device != paged.device:
        raise ValueError(
            f"{chunk_name} is on {chunk.device} but the cache is on {paged.device}: the chunk "
            "must be on the cache's GPU or in pinned CPU memory"
        )


def _launch_paged_copy(
    op: str,
    paged: PagedKV,
    slot_mapping: torch.Tensor,  # [T] int64 (int32 accepted); negative = skip
    chunk: torch.Tensor,  # [KV, len(layers), T, H * D]
    layers: range | None,
    interpret: bool | None,
    config: LaunchConfig | None = None,
) -> None:
    # validate: argument shapes, dtypes and slot range are checked by gather()/scatter();
    # here only where the tensors live, which decides what the kernel can reach.
    layers = range(paged.num_layers) if layers is None else layers
    interpret = paged.device.type == "cpu" if interpret is None else interpret
    chunk_name = "out" if op == "paged_gather" else "src"
    _check_placement(paged, chunk, chunk_name, interpret)
    if len(layers) > 65535:
        raise ValueError(f"at most 65535 layers per launch (grid dim 1); got {len(layers)}")
    num_tokens = slot_mapping.numel()
    if num_tokens == 0 or len(layers) == 0:
        return

    # allocate: nothing big; the cached address table and, if needed, the slots on device.
    table = layer_table(paged, layers)
    words, cache_strides, word_bytes = word_view(paged, chunk, table.alignment)
    slots = slot_mapping.to(paged.device, non_blocking=True)
    head_words = paged.head_size * paged.dtype.itemsize // word_bytes
    row_words = paged.num_heads * head_words
    if config is None:
        config = launch_config(op, row_words, INT_OF_SIZE[word_bytes], paged.device)
    check_launch_config(config, ("block_tokens", "block_row"))
    block_tokens = min(config.block_tokens, next_power_of_2(num_tokens))

    # grid: (token tiles x row blocks, layers, kv planes); dims 1 and 2 are capped at 65535
    row_blocks = -(-row_words // config.block_row)
    token_tiles = -(-num_tokens // block_tokens)
    grid = (token_tiles * row_blocks, len(layers), paged.kv_planes)

    # launch
    kernel = KERNEL.get(interpret)
    device_guard = contextlib.nullcontext() if interpret else torch.cuda.device(paged.device)
    with device_guard:
        if not interpret:
            table.bases.record_stream(torch.cuda.current_stream(paged.device))
        kernel[grid](
            table.bases,  # [len(layers)] int64
            slots,  # [T]
            words,  # [KV, len(layers), T, row_words]
            *cache_strides,
            *words.stride()[:3],
            num_tokens,
            paged.block_size,
            head_words,
            row_words,
            row_blocks,
            TO_CHUNK=op == "paged_gather",
            ALIGNED=table.alignment >= 16,
            BLOCK_T=block_tokens,
            BLOCK_R=config.block_row,
            num_warps=config.num_warps,
        )


def gather_triton(
    paged: PagedKV,
    slot_mapping: torch.Tensor,  # [T] int64 (int32 accepted); negative = skip
    out: torch.Tensor,  # [KV, len(layers), T, H * D], same dtype as the cache
    layers: range | None = None,
    *,
    interpret: bool | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """Triton version of :func:`gather_reference`: one launch for every layer; returns ``out``.

    ``out`` may sit in pinned CPU memory for a GPU cache (the kernel writes it over the
    bus). Like ``copy_(non_blocking=True)`` the launch is asynchronous: synchronize the
    current stream before reading a host ``out``. ``interpret`` picks Triton's interpreter
    (CPU tensors) or the compiled kernel (GPU tensors); None picks by the cache's device.
    ``config`` overrides :func:`launch_config` (the tuner times candidates with it).
    Arguments are assumed valid (:func:`gather` validates them).

    Raises:
        ValueError: the tensors are where this backend cannot reach them (a GPU cache with
            a pageable CPU ``out``, a GPU tensor for the interpreter, ...), or ``config``
            is not a valid launch config.
    """
    _launch_paged_copy("paged_gather", paged, slot_mapping, out, layers, interpret, config)
    return out


def scatter_triton(
    paged: PagedKV,
    slot_mapping: torch.Tensor,  # [T] int64 (int32 accepted); negative = skip
    src: torch.Tensor,  # [KV, len(layers), T, H * D], same dtype as the cache
    layers: range | None = None,
    *,
    interpret: bool | None = None,
    config: LaunchConfig | None = None,
) -> None:
    """Triton version of :func:`scatter_reference`; same arguments as :func:`gather_triton`."""
    _launch_paged_copy("paged_scatter", paged, slot_mapping, src, layers, interpret, config)


# ---------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------


gather_torch = torch_backend(gather_reference, to_chunk=True)
scatter_torch = torch_backend(scatter_reference, to_chunk=False)
registry.register("paged_gather", "torch", gather_torch)
registry.register("paged_scatter", "torch", scatter_torch)
for _op, _launcher in (("paged_gather", gather_triton), ("paged_scatter", scatter_triton)):
    registry.register(_op, "triton", loader=triton_loader(KERNEL, _launcher, False))
    registry.register(_op, "interpret", loader=triton_loader(KERNEL, _launcher, True))
