"""RoPE re-rotation of cached K: move keys stored at ``old_positions`` to ``new_positions``.

RoPE rotations compose, ``R(new) = R(new - old) R(old)``, so keys cached after RoPE at the
positions they were stored at are moved to new positions by rotating each pair of dims by
``delta = new_pos - old_pos`` (non-prefix reuse: blending, position shifts)::

    k                                   [num_layers, T, H * D]  (K plane chunk[0] of KV_2LTD)
    pair i of head h, token t           (x1, x2) = dims (i, i + R/2)   NeoX
                                                 = dims (2i, 2i + 1)   GPT-J
    angle = float32(delta[t]) * inv_freq[i]           inv_freq[i] = base ** (-2i / R)
    (x1, x2) <- (x1 cos - x2 sin, x2 cos + x1 sin)     fp32 math, one rounding per value

``R = rotary_dim`` (<= ``head_size``, even): with partial rotary only the first ``R`` dims
of each head rotate and the rest are left untouched. ``inv_freq`` may be passed instead of
``base`` (scaled variants such as llama3 or YaRN, where the caller computes it).

``k`` is rotated in place. It may be a non-contiguous view (a layer subset or token slice
of a chunk) but its last dim must be dense (stride 1). Bytes moved:
``num_layers * T * H * R * itemsize`` read plus the same written (positions and
``inv_freq`` are negligible).

Backends (see :mod:`kvtier_kernels.registry`): ``torch`` runs the reference below;
``triton`` runs ``rerotate_kernel`` compiled, on CUDA/ROCm tensors; ``interpret`` runs the
same kernel under Triton's interpreter on CPU tensors, one launch for every layer and head.

Sections: torch reference (the definition of correct) -> Triton kernel -> launchers -> registration.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from kvtier_kernels import registry
from kvtier_kernels._launch import LazyKernel, next_power_of_2, triton_loader
from kvtier_kernels.rope.plans import (
    SUPPORTED_DTYPES,
    TorchRotation,
    cached_plan,
    plan_key,
    rope_plan,
    store_plan,
    validate,
)
from kvtier_kernels.tuning.files import Tunable, register_tunable
from kvtier_kernels.tuning.lookup import tuned_config

__all__ = [
    "KERNEL",
    "SUPPORTED_DTYPES",
    "LaunchConfig",
    "launch_config",
    "rerotate",
    "rerotate_kernel",
    "rerotate_reference",
    "rerotate_torch",
    "rerotate_triton",
    "rope_inv_freq",
]


def rope_inv_freq(
    rotary_dim: int, base: float = 10000.0, device: torch.device | str | None = None
) -> torch.Tensor:
    """The standard RoPE frequencies ``base ** (-2i / rotary_dim)``, fp32 ``[rotary_dim // 2]``.

    Computed on the CPU in fp32, as HF transformers and vLLM compute theirs, then moved to
    ``device``: the same bits whatever device the keys live on.
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    return inv_freq if device is None else inv_freq.to(device)


# ---------------------------------------------------------------------------------------
# torch reference
# ---------------------------------------------------------------------------------------


def rerotate_reference(
    k: torch.Tensor,  # [num_layers, T, H * D], rotated in place
    old_positions: torch.Tensor,  # [T] int64
    new_positions: torch.Tensor,  # [T] int64
    *,
    head_size: int,
    rotary_dim: int | None = None,
    base: float = 10000.0,
    inv_freq: torch.Tensor | None = None,  # [rotary_dim // 2] fp32; overrides base
    is_neox_style: bool = True,
) -> torch.Tensor:
    """Rotate ``k`` in place from ``old_positions`` to ``new_positions``; return ``k``.

    Each pair rotates by ``(new - old) * inv_freq`` in fp32 and is rounded once to ``k``'s
    dtype. ``rotary_dim`` defaults to ``head_size``; dims past it are left untouched.
    Arguments are assumed valid (:func:`rerotate` validates them).
    """
    rotary_dim = head_size if rotary_dim is None else rotary_dim
    cos, sin = rotation_cos_sin(k, old_positions, new_positions, rotary_dim, base, inv_freq)
    _rotate(k, cos, sin, head_size, rotary_dim, is_neox_style)
    return k


def rerotate_torch(
    k: torch.Tensor,  # [num_layers, T, H * D], rotated in place
    old_positions: torch.Tensor,  # [T] int64
    new_positions: torch.Tensor,  # [T] int64
    *,
    head_size: int,
    rotary_dim: int | None = None,
    base: float = 10000.0,
    inv_freq: torch.Tensor | None = None,
    is_neox_style: bool = True,
) -> torch.Tensor:
    """The torch backend: the reference's arithmetic, bit-identical (all elementwise), on
    tiles of one layer and ``_TILE_PAIRS`` rotated pairs: fp32 temporaries in cache, each
    op below torch's parallel grain, so one thread and no join (whole-layer ops waited at
    every join for a descheduled thread on a loaded 2-core CPU: 50x slower there)."""
    rotary_dim = head_size if rotary_dim is None else rotary_dim
    cos, sin = rotation_cos_sin(k, old_positions, new_positions, rotary_dim, base, inv_freq)
    tile = max(1, _TILE_PAIRS * head_size // (k.shape[-1] * (rotary_dim // 2)))
    for layer in k.split(1):
        for t in range(0, k.shape[1], tile):
            span = slice(t, t + tile)
            _rotate(
                layer[:, span], cos[:, span], sin[:, span], head_size, rotary_dim, is_neox_style
            )
    return k


_TILE_PAIRS = 32768  # rotated pairs per op in rerotate_torch: torch's parallel grain


def rotation_cos_sin(k, old_positions, new_positions, rotary_dim, base, inv_freq):
    """cos and sin of each token's rotation, ``[1, T, 1, R/2]`` fp32 on ``k``'s device."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(rotary_dim, base)
    delta = new_positions.to(k.device, torch.int64) - old_positions.to(k.device, torch.int64)
    angle = delta.to(torch.float32)[:, None] * inv_freq.to(k.device, torch.float32)[None, :]
    return angle.cos()[None, :, None, :], angle.sin()[None, :, None, :]


def _rotate(k, cos, sin, head_size: int, rotary_dim: int, is_neox_style: bool) -> None:
    half = rotary_dim // 2
    heads = k.unflatten(-1, (k.shape[-1] // head_size, head_size))  # [L, T, H, D], a view
    rotary = heads[..., :rotary_dim]
    if is_neox_style:
        x1, x2 = rotary[..., :half], rotary[..., half:]
    else:
        x1, x2 = rotary[..., 0::2], rotary[..., 1::2]
    # NOTE: both rotated halves are computed before either is written (for fp32, ``f1`` and
    # ``f2`` are views of ``k``, not copies).
    f1, f2 = x1.to(torch.float32), x2.to(torch.float32)
    rotated1 = f1 * cos - f2 * sin
    rotated2 = f2 * cos + f1 * sin
    x1.copy_(rotated1)
    x2.copy_(rotated2)


# ---------------------------------------------------------------------------------------
# Triton kernel
#
# Grid: (token tiles x pair blocks, num_layers, num_heads). Program (p0, layer, head)
# rotates the BLOCK_T x BLOCK_P tile of pairs (tokens tile * BLOCK_T : +BLOCK_T, pairs
# pair_block * BLOCK_P : +BLOCK_P) of one head of one layer. Pair i is dims (i, i + R/2)
# (NeoX) or (2i, 2i + 1) (GPT-J) of the head: both elements of a pair belong to the same
# program, which loads both before it stores either, so rotating in place has no
# read-after-write hazard. A token's dims move in contiguous runs (GPT-J: its pairs'
# 2 * BLOCK_P dims as one tile, split into x1 and x2 in registers). The kernel takes R, not
# R/2: the launcher marks it a multiple of 16 for the usual heads (80 and 112 too), so the
# masks end on 16-byte bounds and aligned caches get 128-bit accesses (test_gpu_compile.py).
#
# NOTE: `tl` is bound to `triton.language` by `LazyKernel.get()` on first use, so that importing
# this module never imports triton. The kernel calls only Triton builtins (tl.cos and
# tl.sin included; Triton, not the source, picks their libdevice lowering).
# ---------------------------------------------------------------------------------------

tl: Any = None


def rerotate_kernel(
    k,  # [num_layers, T, H * D], rotated in place
    old_positions,  # [T] int64
    new_positions,  # [T] int64
    inv_freq,  # [R / 2] fp32
    s_layer,  # k strides, in elements
    s_token,
    s_dim,
    num_tokens,
    head_size,
    rotary_dim,
    pair_blocks,
    IS_NEOX: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    tile_and_pair_block = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2).to(tl.int64)
    tile = tile_and_pair_block // pair_blocks
    pair_block = tile_and_pair_block - tile * pair_blocks

    tokens = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    pairs = pair_block * BLOCK_P + tl.arange(0, BLOCK_P)
    token_in = tokens < num_tokens
    pair_in = pairs < rotary_dim // 2
    mask = token_in[:, None] & pair_in[None, :]

    old = tl.load(old_positions + tokens, mask=token_in, other=0)
    new = tl.load(new_positions + tokens, mask=token_in, other=0)
    freq = tl.load(inv_freq + pairs, mask=pair_in, other=0.0)
    angle = (new - old).to(tl.float32)[:, None] * freq[None, :]
    cos = tl.cos(angle)
    sin = tl.sin(angle)

    rows = layer * s_layer + tokens.to(tl.int64) * s_token + head * head_size * s_dim
    if IS_NEOX:  # x1 and x2: two runs of BLOCK_P contiguous dims, R/2 apart
        x1_ptrs = k + rows[:, None] + pairs.to(tl.int64)[None, :] * s_dim
        x2_ptrs = k + rows[:, None] + (pairs + rotary_dim // 2).to(tl.int64)[None, :] * s_dim
        x1 = tl.load(x1_ptrs, mask=mask).to(tl.float32)
        x2 = tl.load(x2_ptrs, mask=mask).to(tl.float32)
        tl.store(x1_ptrs, (x1 * cos - x2 * sin).to(k.dtype.element_ty), mask=mask)
        tl.store(x2_ptrs, (x2 * cos + x1 * sin).to(k.dtype.element_ty), mask=mask)
    else:  # interleaved pairs: one contiguous tile of 2 * BLOCK_P dims, split in registers
        dims = pair_block * (2 * BLOCK_P) + tl.arange(0, 2 * BLOCK_P)
        dims_mask = token_in[:, None] & (dims < 2 * (rotary_dim // 2))[None, :]  # R, known even
        ptrs = k + rows[:, None] + dims.to(tl.int64)[None, :] * s_dim
        x = tl.load(ptrs, mask=dims_mask).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_P, 2)))  # dims 2i, 2i + 1
        rotated = tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin)
        rotated = tl.reshape(rotated, (BLOCK_T, 2 * BLOCK_P)).to(k.dtype.element_ty)
        tl.store(ptrs, rotated, mask=dims_mask)


# ---------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------


def rerotate(
    k: torch.Tensor,  # [num_layers, T, H * D], rotated in place
    old_positions: torch.Tensor,  # [T] int64
    new_positions: torch.Tensor,  # [T] int64
    *,
    head_size: int,
    rotary_dim: int | None = None,
    base: float = 10000.0,
    inv_freq: torch.Tensor | None = None,  # [rotary_dim // 2] fp32; overrides base
    is_neox_style: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """Re-rotate cached keys in place from ``old_positions`` to ``new_positions``.

    Args:
        k: keys after RoPE, ``[num_layers, num_tokens, num_heads * head_size]`` (the K plane
            ``chunk[0]`` of a ``KV_2LTD`` chunk, or any view of one), bf16/fp16/fp32, last
            dim contiguous. Rotated in place.
        old_positions, new_positions: ``[num_tokens]`` int64 (int32 accepted): the position
            each token was rotated for, and the one it should be rotated for.
        head_size: dims per head.
        rotary_dim: leading dims of each head that RoPE rotates (even, <= ``head_size``;
            default ``head_size``); the rest are left untouched.
        base: RoPE theta; frequencies ``base ** (-2i / rotary_dim)`` (:func:`rope_inv_freq`).
        inv_freq: explicit frequencies ``[rotary_dim // 2]``, used instead of ``base`` (for
            scaled variants: llama3, YaRN, ...); converted to fp32.
        is_neox_style: NeoX pairing (dim ``i`` with ``i + rotary_dim / 2``) if True, else
            GPT-J pairing (dims ``2i`` and ``2i + 1``).
        backend: ``"auto"``, ``"torch"``, ``"numba"``, ``"triton"`` or ``"interpret"``.

    Returns:
        ``k``.

    Raises:
        TypeError / ValueError: a wrong argument type, shape, dtype or stride (the message
            names the argument and the expected shape), or a backend that cannot run on
            ``k``'s device.

    NOTE: what depends only on the arguments' shapes, strides, dtypes, devices and
    alignment, the rotary settings and the backend is computed once and cached
    (:mod:`~kvtier_kernels.rope.plans`); int64 positions on ``k``'s device (and
    ``inv_freq``, if given, fp32 there) are used as they are, without a copy.
    """
    try:
        key = plan_key(backend, k, old_positions, new_positions, inv_freq)
        key += (head_size, rotary_dim, base, is_neox_style)
        bound = cached_plan(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: validate
        key, bound = None, None
    if bound is None:
        rotary = validate(k, old_positions, new_positions, head_size, rotary_dim, base, inv_freq)
        impl = registry.get("rope_rerotate", backend, k.device)
        if isinstance(impl, functools.partial) and impl.func is rerotate_triton:
            interpret = impl.keywords["interpret"]
            freqs = (
                None if inv_freq is not None else _cached_inv_freq(rotary, float(base), k.device)
            )
            bound = rope_plan(
                k, old_positions, new_positions, inv_freq, freqs, head_size, rotary,
                is_neox_style, interpret, KERNEL, launch_config,
            )  # fmt: skip
        else:
            bound = TorchRotation(impl, head_size, rotary, base, is_neox_style)
        if key is not None:
            store_plan(key, bound)
    return bound(k, old_positions, new_positions, inv_freq)


# ---------------------------------------------------------------------------------------
# Triton launchers
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Launch parameters of one re-rotation launch.

    Attributes:
        block_tokens: tokens per program (``BLOCK_T``), a power of two.
        block_pairs: rotary pairs per program (``BLOCK_P``), a power of two; heads with more
            pairs are split over several programs.
        num_warps: warps per program, one of 1, 2, 4, 8, 16.
    """

    block_tokens: int
    block_pairs: int
    num_warps: int


# launch_config(half_rotary, num_tokens, dtype, device)
register_tunable(
    Tunable(
        "rope_rerotate",
        ("half_rotary",),
        "num_tokens",
        ("block_tokens", "block_pairs", "num_warps"),
    )
)

_GPU_TILE_PAIRS = 1024  # pairs per program on a GPU: 8 KiB of fp32 math on 2 warps
_INTERPRETER_TILE_PAIRS = 1 << 14  # the interpreter pays ~1 ms per program: fewer, bigger ones


def launch_config(
    half_rotary: int,
    num_tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    tuned: bool = True,
) -> LaunchConfig:
    """Launch parameters for rotating ``half_rotary`` pairs per head of ``num_tokens`` tokens.

    A per-device tuning file written by ``kvtier tune`` wins when it has an entry for this
    ``half_rotary`` (:func:`kvtier_kernels.tuning.lookup.tuned_config`: files named by op,
    backend, device and ``dtype``; the entry for the closest token count, ``block_tokens``
    capped at the tokens there are). Otherwise, and always with ``tuned=False`` (the tuner's
    baseline), a whole head's pairs per program when they fit (up to 128), about 1024 pairs
    per program (16 Ki under the interpreter, where each program costs about 1 ms), a warp
    per 512 pairs (16 bytes of a bf16 half-tile per lane on 64-lane wavefronts: 128 bits).
    """
    key = {"half_rotary": half_rotary, "num_tokens": num_tokens}
    found = tuned_config("rope_rerotate", device, dtype, key) if tuned else None
    if found is not None:
        config = LaunchConfig(**found)
        capped = min(config.block_tokens, next_power_of_2(max(1, num_tokens)))
        return LaunchConfig(capped, config.block_pairs, config.num_warps)
    tile_pairs = _GPU_TILE_PAIRS if device.type == "cuda" else _INTERPRETER_TILE_PAIRS
    block_pairs = min(next_power_of_2(half_rotary), 128)
    block_tokens = min(next_power_of_2(num_tokens), max(1, tile_pairs // block_pairs))
    num_warps = max(1, min(8, block_tokens * block_pairs // 512))
    return LaunchConfig(block_tokens, block_pairs, next_power_of_2(num_warps))


KERNEL = LazyKernel(rerotate_kernel)
"""The re-rotation kernel, decorated (compiled or interpreted) on first use."""


@functools.lru_cache(maxsize=64)
def _cached_inv_freq(rotary_dim: int, base: float, device: torch.device) -> torch.Tensor:
    """:func:`rope_inv_freq` on ``device``, built once per (rotary_dim, base, device)."""
    return rope_inv_freq(rotary_dim, base, device)


def rerotate_triton(
    k: torch.Tensor,  # [num_layers, T, H * D], rotated in place
    old_positions: torch.Tensor,  # [T] int64
    new_positions: torch.Tensor,  # [T] int64
    *,
    head_size: int,
    rotary_dim: int | None = None,
    base: float = 10000.0,
    inv_freq: torch.Tensor | None = None,  # [rotary_dim // 2] fp32; overrides base
    is_neox_style: bool = True,
    interpret: bool | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """Triton version of :func:`rerotate_reference`: one launch for every layer and head.

    Returns ``k``. The launch is asynchronous on the current stream. ``interpret`` picks
    Triton's interpreter (CPU tensors) or the compiled kernel (GPU tensors); None picks by
    ``k``'s device. ``config`` overrides :func:`launch_config` (the tuner times candidates
    with it). Arguments are assumed valid (:func:`rerotate` validates them).

    Raises:
        ValueError: ``k`` is where this backend cannot reach it, or more than 65535 layers
            or heads (grid dims 1 and 2).
    """
    interpret = k.device.type == "cpu" if interpret is None else interpret
    rotary_dim = head_size if rotary_dim is None else rotary_dim
    key = plan_key(("triton", interpret, config), k, old_positions, new_positions, inv_freq)
    key += (head_size, rotary_dim, base, is_neox_style)
    plan = cached_plan(key)
    if plan is None:
        freqs = (
            None if inv_freq is not None else _cached_inv_freq(rotary_dim, float(base), k.device)
        )
        plan = rope_plan(
            k, old_positions, new_positions, inv_freq, freqs, head_size, rotary_dim,
            is_neox_style, interpret, KERNEL, launch_config, config,
        )  # fmt: skip
        store_plan(key, plan)
    return plan(k, old_positions, new_positions, inv_freq)


# ---------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------

registry.register("rope_rerotate", "torch", rerotate_torch)
registry.register("rope_rerotate", "triton", loader=triton_loader(KERNEL, rerotate_triton, False))
registry.register("rope_rerotate", "interpret", loader=triton_loader(KERNEL, rerotate_triton, True))
