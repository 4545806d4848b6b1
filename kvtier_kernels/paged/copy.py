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

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvtier_kernels import registry
from kvtier_kernels._launch import LazyKernel, next_power_of_2, numba_loader, triton_loader
from kvtier_kernels.layouts import PagedKV
from kvtier_kernels.paged.numba_rows import NUMBA_KERNELS, numba_backend
from kvtier_kernels.paged.plans import (
    TorchCopy,
    cached_plan,
    copy_plan,
    plan_key,
    store_plan,
    validate,
)
from kvtier_kernels.paged.rows import as_words, read_rows, torch_backend, valid_slots
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
    num_slots,  # slots >= num_slots are skipped, as negative ones
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
    mask = (cols[None, :] < row_words) & ((slots >= 0) & (slots < num_slots))[:, None]

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

    NOTE: everything that depends only on the cache, ``layers``, the backend and the
    arguments' shapes, strides, dtypes, devices and alignment is computed once and cached
    (:mod:`~kvtier_kernels.paged.plans`). A slot mapping in host memory is range-checked on
    every call (and copied to the cache's device); one on the GPU is not read back (no
    sync): the Triton kernel skips a slot ``>= paged.num_slots`` as it skips a negative one.
    """
    _bound("paged_gather", paged, slot_mapping, out, layers, backend)(slot_mapping, out)
    return out


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
    _bound("paged_scatter", paged, slot_mapping, src, layers, backend)(slot_mapping, src)


def _bound(
    op: str,
    paged: PagedKV,
    slot_mapping: torch.Tensor,
    chunk: torch.Tensor,
    layers: range | None,
    backend: str,
) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """The cached plan of this call (validating the arguments and building it on a miss)."""
    try:
        key = plan_key(op, backend, layers, slot_mapping, chunk)
        bound = cached_plan(paged, key)
    except (AttributeError, TypeError):  # not tensors, or layers not a range: validate
        key, bound = None, None
    if bound is not None:
        return bound
    layers = validate(paged, slot_mapping, chunk, "out" if op == "paged_gather" else "src", layers)
    impl = registry.get(op, backend, paged.device)
    if isinstance(impl, functools.partial) and impl.func in (gather_triton, scatter_triton):
        interpret = impl.keywords["interpret"]
        bound = copy_plan(op, paged, slot_mapping, chunk, layers, interpret, KERNEL, launch_config)
    else:
        bound = TorchCopy(impl, paged, layers)
    if key is not None:
        store_plan(paged, key, bound)
    return bound


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


def _launch_paged_copy(
    op: str,
    paged: PagedKV,
    slot_mapping: torch.Tensor,  # [T] int64 (int32 accepted); negative = skip
    chunk: torch.Tensor,  # [KV, len(layers), T, H * D]
    layers: range | None,
    interpret: bool | None,
    config: LaunchConfig | None,
) -> None:
    """Launch ``op`` through its cached plan (one per ``config``; see :func:`gather_triton`)."""
    layers = range(paged.num_layers) if layers is None else layers
    interpret = paged.device.type == "cpu" if interpret is None else interpret
    key = plan_key(op, ("triton", interpret, config), layers, slot_mapping, chunk)
    plan = cached_plan(paged, key)
    if plan is None:
        plan = copy_plan(
            op, paged, slot_mapping, chunk, layers, interpret, KERNEL, launch_config, config, False
        )
        store_plan(paged, key, plan)
    plan(slot_mapping, chunk)


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
for _op, _launcher, _torch in (
    ("paged_gather", gather_triton, gather_torch),
    ("paged_scatter", scatter_triton, scatter_torch),
):
    _numba = numba_backend(_torch, to_chunk=_op == "paged_gather")
    registry.register(
        _op, "numba", loader=numba_loader([NUMBA_KERNELS[_op == "paged_gather"]], _numba)
    )
    registry.register(_op, "triton", loader=triton_loader(KERNEL, _launcher, False))
    registry.register(_op, "interpret", loader=triton_loader(KERNEL, _launcher, True))
