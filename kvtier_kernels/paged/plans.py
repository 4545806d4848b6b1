"""Launch plans of the paged copies: what a gather or scatter computes once per cache,
chunk geometry and backend, and the little left to do per call.

A call of :func:`~kvtier_kernels.paged.copy.gather` / ``scatter`` looks up its plan in
the cache's :func:`~kvtier_kernels.paged.rows.launch_cache` under a key of what the plan
depends on (op, backend, layers, the slot mapping's length, dtype, device and alignment,
the chunk's shape, strides, dtype, device and alignment). A miss validates the arguments
and builds the plan: the layer-address table (on the device once per cache), the word type
and strides, the launch config, the grid, the constexprs and, for Triton, the kernel bound
and compiled for those arguments (:func:`kvtier_kernels._launch.bind`). A hit skips all of
that, so a call costs a dict lookup and the launch::

    key -> CopyPlan:  [host slots: range check on the host copy, then to the device]
                      [pinned chunk: is_pinned]  ->  BoundLaunch(bases, slots, chunk)

Slots on the device are never read back (no sync): the kernel itself skips a slot outside
``[0, num_slots)``, so a bad slot never touches memory outside the cache; check slots where
they are built (``PagedIO.device_slots`` does, once per batch, on the host copy).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from kvtier_kernels._launch import (
    BoundLaunch,
    LazyKernel,
    bind,
    check_launch_config,
    next_power_of_2,
    upload,
)
from kvtier_kernels.dtypes import INT_OF_SIZE
from kvtier_kernels.layouts import PagedKV
from kvtier_kernels.paged.rows import launch_cache, layer_table, word_view

__all__ = [
    "MAX_PLANS",
    "CopyPlan",
    "TorchCopy",
    "cached_plan",
    "check_placement",
    "check_slot_range",
    "copy_plan",
    "plan_key",
    "store_plan",
    "validate",
]

MAX_PLANS = 512
"""Plans kept per cache (the oldest go first): every layer and one layer at a time, both
directions, every chunk length up to a few hundred, in a few hundred bytes each."""


def validate(
    paged: PagedKV,
    slot_mapping: torch.Tensor,
    chunk: torch.Tensor,
    chunk_name: str,
    layers: range | None,
) -> range:
    """Check the arguments of gather/scatter (all but the slots' range, see
    :func:`check_slot_range`); return the layer range to use."""
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
    return layers


def check_slot_range(paged: PagedKV, slot_mapping: torch.Tensor) -> None:
    """Raise ValueError naming the first slot ``>= paged.num_slots`` (reads the slots:
    a device sync for slots on a GPU)."""
    if slot_mapping.numel():
        largest = int(slot_mapping.max())
        if largest >= paged.num_slots:
            position = int(slot_mapping.argmax())
            raise ValueError(
                f"slot_mapping[{position}] = {largest} is out of range: the cache has "
                f"{paged.num_slots} slots (num_blocks={paged.num_blocks} x "
                f"block_size={paged.block_size})"
            )


def check_placement(paged: PagedKV, chunk: torch.Tensor, chunk_name: str, interpret: bool) -> None:
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
            raise _pageable(chunk_name)
    elif chunk.device != paged.device:
        raise ValueError(
            f"{chunk_name} is on {chunk.device} but the cache is on {paged.device}: the chunk "
            "must be on the cache's GPU or in pinned CPU memory"
        )


def _pageable(chunk_name: str) -> ValueError:
    return ValueError(
        f"{chunk_name} is in pageable CPU memory, which a GPU kernel cannot reach: "
        "allocate it with pin_memory=True, or use backend 'torch'"
    )


def plan_key(
    op: str, backend: Any, layers: Any, slot_mapping: torch.Tensor, chunk: torch.Tensor
) -> tuple:
    """What a plan depends on, read off the arguments without a sync (raises TypeError or
    AttributeError for arguments that are not tensors or ranges: validate those)."""
    return (
        op,
        backend,
        layers,
        slot_mapping.shape,
        slot_mapping.dtype,
        slot_mapping.get_device(),
        slot_mapping.data_ptr() & 15,
        chunk.shape,
        chunk.stride(),
        chunk.dtype,
        chunk.get_device(),
        chunk.data_ptr() & 15,
    )


def cached_plan(paged: PagedKV, key: tuple) -> Callable[..., Any] | None:
    """The plan stored under ``key`` for ``paged``, or None."""
    return launch_cache(paged).get(key)


_PLAN_OPS = ("paged_gather", "paged_scatter")  # the first item of a plan's key
_store_lock = threading.Lock()  # one cache may be stored into from several threads


def store_plan(paged: PagedKV, key: tuple, plan: Callable[..., Any]) -> None:
    """Keep ``plan`` under ``key`` for ``paged`` (dropping the oldest past MAX_PLANS)."""
    cache = launch_cache(paged)
    with _store_lock:
        cache[key] = plan
        if len(cache) > MAX_PLANS:
            for old in [k for k in list(cache) if isinstance(k, tuple) and k[0] in _PLAN_OPS]:
                if len(cache) <= MAX_PLANS:
                    break
                del cache[old]


class TorchCopy:
    """A paged copy on a backend other than Triton's (the torch backend, or an
    implementation registered in its place), with its layers bound; checks the slots'
    range on every call (a sync for slots on a GPU, as the torch ops would fault)."""

    __slots__ = ("impl", "layers", "paged")

    def __init__(self, impl: Callable, paged: PagedKV, layers: range) -> None:
        self.impl, self.paged, self.layers = impl, paged, layers

    def __call__(self, slot_mapping: torch.Tensor, chunk: torch.Tensor) -> Any:
        check_slot_range(self.paged, slot_mapping)
        return self.impl(self.paged, slot_mapping, chunk, self.layers)


class CopyPlan:
    """One paged copy bound to its cache, layers and chunk geometry: ``plan(slot_mapping,
    chunk, stream=None)`` launches the kernel (see the module docstring for what a call
    does). Built by :func:`copy_plan`."""

    __slots__ = ("bases", "check_slots", "chunk_name", "device", "launch", "move_slots")
    __slots__ += ("paged", "pinned_chunk", "word_dtype")

    def __init__(
        self,
        paged: PagedKV,
        launch: BoundLaunch | None,
        bases: torch.Tensor | None,
        chunk_name: str,
        word_dtype: torch.dtype | None,
        pinned_chunk: bool,
        host_slots: bool,
        check_slots: bool,
    ) -> None:
        self.paged, self.launch, self.bases, self.chunk_name = paged, launch, bases, chunk_name
        self.word_dtype, self.pinned_chunk = word_dtype, pinned_chunk
        self.device = paged.device
        self.check_slots = check_slots and host_slots
        self.move_slots = host_slots and self.device.type != "cpu"

    def __call__(
        self, slot_mapping: torch.Tensor, chunk: torch.Tensor, stream: int | None = None
    ) -> None:
        if self.launch is None:  # no tokens or no layers: nothing to move
            return
        if self.check_slots:
            check_slot_range(self.paged, slot_mapping)
        if self.move_slots:
            slot_mapping = upload(slot_mapping, self.device)
        if self.pinned_chunk and not chunk.is_pinned():
            raise _pageable(self.chunk_name)
        if self.word_dtype is not None:  # the interpreter reads through the tensor's dtype
            chunk = chunk.view(self.word_dtype)
        self.launch(self.bases, slot_mapping, chunk, stream=stream)


def copy_plan(
    op: str,
    paged: PagedKV,
    slot_mapping: torch.Tensor,  # [T] int64 (int32 accepted); negative = skip
    chunk: torch.Tensor,  # [KV, len(layers), T, H * D]
    layers: range,
    interpret: bool,
    kernel: LazyKernel,
    launch_config: Callable[[str, int, torch.dtype, torch.device], Any],
    config: Any = None,
    check_slots: bool = True,
) -> CopyPlan:
    """Build the plan of ``op`` (``"paged_gather"`` / ``"paged_scatter"``) for arguments
    shaped as these (already validated by :func:`validate`): check the placement, build the
    address table, pick the word type and the launch config (``config``, else
    ``launch_config(op, row_words, word_dtype, device)``), the grid, and bind ``kernel``.
    ``check_slots``: the plan range-checks slots that come in host memory.

    Raises:
        ValueError: the tensors are where the kernel cannot reach them, more than 65535
            layers, or an invalid ``config``.
    """
    chunk_name = "out" if op == "paged_gather" else "src"
    check_placement(paged, chunk, chunk_name, interpret)
    if len(layers) > 65535:
        raise ValueError(f"at most 65535 layers per launch (grid dim 1); got {len(layers)}")
    num_tokens = slot_mapping.numel()
    host_slots = slot_mapping.device.type == "cpu"
    pinned = not interpret and chunk.device.type == "cpu"
    if num_tokens == 0 or len(layers) == 0:
        return CopyPlan(paged, None, None, chunk_name, None, pinned, host_slots, check_slots)

    table = layer_table(paged, layers)
    words, cache_strides, word_bytes = word_view(paged, chunk, table.alignment)
    word_dtype = INT_OF_SIZE[word_bytes]
    slots = slot_mapping.to(paged.device)
    head_words = paged.head_size * paged.dtype.itemsize // word_bytes
    row_words = paged.num_heads * head_words
    if config is None:
        config = launch_config(op, row_words, word_dtype, paged.device)
    check_launch_config(config, ("block_tokens", "block_row"))
    block_tokens = min(config.block_tokens, next_power_of_2(num_tokens))

    # grid: (token tiles x row blocks, layers, kv planes); dims 1 and 2 are capped at 65535
    row_blocks = -(-row_words // config.block_row)
    token_tiles = -(-num_tokens // block_tokens)
    grid = (token_tiles * row_blocks, len(layers), paged.kv_planes)
    args = (
        table.bases,  # [len(layers)] int64
        slots,  # [T]
        words,  # [KV, len(layers), T, row_words]
        *cache_strides,
        *words.stride()[:3],
        num_tokens,
        paged.num_slots,
        paged.block_size,
        head_words,
        row_words,
        row_blocks,
    )
    meta = {
        "TO_CHUNK": op == "paged_gather",
        "ALIGNED": table.alignment >= 16,
        "BLOCK_T": block_tokens,
        "BLOCK_R": config.block_row,
        "num_warps": config.num_warps,
    }
    device_index = None if interpret else paged.device.index
    if device_index is None and not interpret:
        device_index = torch.cuda.current_device()
    launch = bind(kernel, interpret, grid, args, meta, device_index, per_call=3)
    word = word_dtype if interpret else None
    return CopyPlan(paged, launch, table.bases, chunk_name, word, pinned, host_slots, check_slots)
