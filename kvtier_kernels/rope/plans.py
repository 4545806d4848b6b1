"""Launch plans of RoPE re-rotation: what a ``rerotate`` call computes once per shape,
strides, dtypes, rotary settings and backend, and the little left to do per call.

:func:`~kvtier_kernels.rope.rerotation.rerotate` looks its plan up under a key of the
arguments' shapes, strides, dtypes, devices and alignment plus ``head_size``,
``rotary_dim``, ``base``, ``is_neox_style`` and the backend (no tensor address: ``k`` and
the positions are passed per call). A miss validates the arguments and builds the plan:
the frequencies (built once per rotary dim, base and device), the launch config, the grid,
the constexprs and, for Triton, the kernel bound and compiled for those arguments. A hit
launches at once: cos and sin are computed in the kernel from the positions, so a call
allocates nothing when the positions are int64 on ``k``'s device (other positions are
converted per call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvtier_kernels._launch import (
    BoundLaunch,
    LazyKernel,
    bind,
    check_launch_config,
    upload,
)
from kvtier_kernels.plan_cache import PlanCache

__all__ = [
    "MAX_PLANS",
    "SUPPORTED_DTYPES",
    "RotationPlan",
    "TorchRotation",
    "cached_plan",
    "check_placement",
    "clear_plans",
    "plan_key",
    "rope_plan",
    "store_plan",
    "validate",
]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

MAX_PLANS = 256
"""Plans kept (the oldest go first): one per token count, layer count and rotary setting."""

_plans = PlanCache(MAX_PLANS)


def _check_positions(name: str, positions: Any, num_tokens: int) -> None:
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(positions).__name__}")
    if positions.dim() != 1 or positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"{name} must be a 1-D int64 (or int32) tensor [num_tokens]; "
            f"got shape {tuple(positions.shape)} dtype {positions.dtype}"
        )
    if positions.numel() != num_tokens:
        raise ValueError(
            f"{name} must have one position per token of k: shape ({num_tokens},); "
            f"got {tuple(positions.shape)}"
        )


def validate(
    k: Any,
    old_positions: Any,
    new_positions: Any,
    head_size: Any,
    rotary_dim: Any,
    base: Any,
    inv_freq: Any,
) -> int:
    """Check the arguments of ``rerotate``; return the rotary dim to use."""
    if not isinstance(k, torch.Tensor):
        raise TypeError(f"k must be a torch.Tensor, got {type(k).__name__}")
    if k.dim() != 3:
        raise ValueError(
            "k must be 3-D [num_layers, num_tokens, num_heads * head_size] (the K plane "
            f"chunk[0] of a KV_2LTD chunk); got shape {tuple(k.shape)}"
        )
    if k.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"k has dtype {k.dtype}; supported: {', '.join(str(d) for d in SUPPORTED_DTYPES)}"
        )
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size <= 0:
        raise ValueError(f"head_size must be a positive int; got {head_size!r}")
    if k.shape[-1] % head_size:
        raise ValueError(
            f"k's last dim {k.shape[-1]} must be num_heads * head_size: it is not divisible "
            f"by head_size={head_size} (k shape {tuple(k.shape)})"
        )
    if k.shape[-1] > 1 and k.stride(-1) != 1:
        raise ValueError(
            f"k must be contiguous in its last dim (stride 1); got strides {k.stride()}"
        )

    rotary_dim = head_size if rotary_dim is None else rotary_dim
    if (
        isinstance(rotary_dim, bool)
        or not isinstance(rotary_dim, int)
        or rotary_dim <= 0
        or rotary_dim % 2
        or rotary_dim > head_size
    ):
        raise ValueError(
            f"rotary_dim must be a positive even int <= head_size={head_size}; got {rotary_dim!r}"
        )

    _check_positions("old_positions", old_positions, k.shape[1])
    _check_positions("new_positions", new_positions, k.shape[1])

    if inv_freq is None:
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 0:
            raise ValueError(f"base must be a positive number; got {base!r}")
    else:
        if not isinstance(inv_freq, torch.Tensor):
            raise TypeError(f"inv_freq must be a torch.Tensor, got {type(inv_freq).__name__}")
        if inv_freq.shape != (rotary_dim // 2,) or not inv_freq.is_floating_point():
            raise ValueError(
                f"inv_freq must be a 1-D float tensor [rotary_dim // 2] = ({rotary_dim // 2},); "
                f"got shape {tuple(inv_freq.shape)} dtype {inv_freq.dtype}"
            )
    return rotary_dim


def check_placement(k: torch.Tensor, interpret: bool) -> None:
    """Raise ValueError when the kernel could not reach ``k``."""
    if interpret and k.device.type != "cpu":
        raise ValueError(
            f"kernel backend 'interpret' runs on CPU tensors; k is on {k.device} "
            "(use 'triton' for GPU tensors)"
        )
    if not interpret and k.device.type != "cuda":
        raise ValueError(
            f"kernel backend 'triton' needs k on a CUDA/ROCm GPU; k is on {k.device} "
            "(use 'interpret' or 'torch')"
        )


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15)


def plan_key(
    backend: Any,
    k: torch.Tensor,
    old_positions: torch.Tensor,
    new_positions: torch.Tensor,
    inv_freq: torch.Tensor | None,
) -> tuple:
    """The tensor part of a plan's key, read off the arguments without a sync (raises
    AttributeError for arguments that are not tensors: validate those)."""
    freq = None if inv_freq is None else _tensor_key(inv_freq)
    return (backend, *_tensor_key(k), _tensor_key(old_positions), _tensor_key(new_positions), freq)


def cached_plan(key: tuple) -> Callable[..., torch.Tensor] | None:
    """The plan stored under ``key``, or None (raises TypeError for an unhashable key)."""
    return _plans.get(key)


def clear_plans() -> None:
    """Drop every cached plan (benchmarks time the path without them)."""
    _plans.clear()


def store_plan(key: tuple, plan: Callable[..., torch.Tensor]) -> None:
    """Keep ``plan`` under ``key`` (dropping the oldest past MAX_PLANS)."""
    _plans.put(key, plan)


class TorchRotation:
    """A re-rotation on a backend other than Triton's (torch, numba, or an implementation
    registered in their place) with its settings bound."""

    __slots__ = ("base", "head_size", "impl", "is_neox_style", "rotary_dim")

    def __init__(
        self, impl: Callable, head_size: int, rotary_dim: int, base: float, is_neox_style: bool
    ) -> None:
        self.impl, self.head_size, self.rotary_dim = impl, head_size, rotary_dim
        self.base, self.is_neox_style = base, is_neox_style

    def __call__(self, k, old_positions, new_positions, inv_freq) -> torch.Tensor:
        return self.impl(
            k,
            old_positions,
            new_positions,
            head_size=self.head_size,
            rotary_dim=self.rotary_dim,
            base=self.base,
            inv_freq=inv_freq,
            is_neox_style=self.is_neox_style,
        )


class RotationPlan:
    """One re-rotation bound to its shapes and settings: ``plan(k, old_positions,
    new_positions, inv_freq)`` launches the kernel and returns ``k``. Built by
    :func:`rope_plan`."""

    __slots__ = ("convert", "freqs", "launch")

    def __init__(
        self, launch: BoundLaunch | None, freqs: torch.Tensor | None, convert: bool
    ) -> None:
        self.launch, self.freqs, self.convert = launch, freqs, convert

    def __call__(
        self,
        k: torch.Tensor,
        old_positions: torch.Tensor,
        new_positions: torch.Tensor,
        inv_freq: torch.Tensor | None,
    ) -> torch.Tensor:
        if self.launch is None:  # nothing to rotate
            return k
        freqs = self.freqs
        if self.convert:  # positions or frequencies not yet int64 / fp32 on k's device
            device = k.device
            old_positions = upload(old_positions, device, torch.int64)
            new_positions = upload(new_positions, device, torch.int64)
            if inv_freq is not None:
                freqs = upload(inv_freq, device, torch.float32)
        elif freqs is None:
            freqs = inv_freq
        self.launch(k, old_positions, new_positions, freqs)
        return k


def rope_plan(
    k: torch.Tensor,  # [num_layers, T, H * D]
    old_positions: torch.Tensor,  # [T] int64 (int32 accepted)
    new_positions: torch.Tensor,  # [T]
    inv_freq: torch.Tensor | None,  # [R / 2]; None: ``freqs``
    freqs: torch.Tensor | None,  # [R / 2] fp32 on k's device, when inv_freq is None
    head_size: int,
    rotary_dim: int,
    is_neox_style: bool,
    interpret: bool,
    kernel: LazyKernel,
    launch_config: Callable[[int, int, torch.dtype, torch.device], Any],
    config: Any = None,
) -> RotationPlan:
    """Build the plan of a re-rotation for arguments shaped as these (already validated
    by :func:`validate`): check the placement, pick the launch config (``config``, else
    ``launch_config(half_rotary, num_tokens, dtype, device)``), the grid, and bind
    ``kernel``.

    Raises:
        ValueError: ``k`` is where the kernel cannot reach it, more than 65535 layers or
            heads (grid dims 1 and 2), or an invalid ``config``.
    """
    check_placement(k, interpret)
    num_layers, num_tokens, width = k.shape
    num_heads = width // head_size
    for name, size in (("layers", num_layers), ("heads", num_heads)):
        if size > 65535:
            raise ValueError(f"at most 65535 {name} per launch (a grid dim); got {size}")
    device = k.device
    convert = any(
        p.dtype != torch.int64 or p.device != device for p in (old_positions, new_positions)
    )
    if inv_freq is not None:
        convert |= inv_freq.dtype != torch.float32 or inv_freq.device != device
    if k.numel() == 0:
        return RotationPlan(None, freqs, convert)

    old = old_positions.to(device, torch.int64)
    new = new_positions.to(device, torch.int64)
    warm_freqs = freqs if inv_freq is None else inv_freq.to(device, torch.float32)
    half_rotary = rotary_dim // 2
    if config is None:
        config = launch_config(half_rotary, num_tokens, k.dtype, device)
    check_launch_config(config, ("block_tokens", "block_pairs"))

    # grid: (token tiles x pair blocks, layers, heads)
    pair_blocks = -(-half_rotary // config.block_pairs)
    token_tiles = -(-num_tokens // config.block_tokens)
    grid = (token_tiles * pair_blocks, num_layers, num_heads)
    args = (
        k,  # [num_layers, T, H * D]
        old,  # [T] int64
        new,  # [T] int64
        warm_freqs,  # [R / 2] fp32
        *k.stride(),
        num_tokens,
        head_size,
        rotary_dim,
        pair_blocks,
    )
    meta = {
        "IS_NEOX": bool(is_neox_style),
        "BLOCK_T": config.block_tokens,
        "BLOCK_P": config.block_pairs,
        "num_warps": config.num_warps,
    }
    device_index = None if interpret else device.index
    launch = bind(kernel, interpret, grid, args, meta, device_index, per_call=4)
    return RotationPlan(launch, freqs, convert)
