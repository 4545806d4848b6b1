"""RoPE re-rotation as a numba CPU kernel: the ``numba`` backend of ``rope_rerotate``.

Computes what :func:`kvtier_kernels.rope.rerotation.rerotate_reference` computes, bit for bit (the
tests compare them): each rotary pair ``(x1, x2)`` of each head becomes
``(x1 cos - x2 sin, x2 cos + x1 sin)`` in float32, every product and sum rounded to
float32 on its own (no fused multiply-add), then rounded once to the keys' dtype (round
to nearest even for bf16). cos and sin come from the reference's own ``rotation_cos_sin``
(torch, ``[T, R/2]`` float32), so only the rotation runs here.

Bytes moved: the rotary dims of K once read, once written, in place (torch's eager
reference makes about ten float32 passes over them). Layout: ``k`` ``[L, T, H * D]``,
any strides with the last dim contiguous; bf16 and float32 are read as their bits
(uint16 shifted up, uint32), fp16 goes to the torch backend. One thread, a
``(layer, token)`` row at a time: the kernel is serial (no numba threading layer; see
``NUMBA_KERNEL``).
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier_kernels import registry
from kvtier_kernels._launch import NumbaKernel, numba_loader
from kvtier_kernels.rope.rerotation import rerotate_torch, rotation_cos_sin

__all__ = ["NUMBA_KERNEL", "rerotate_numba"]


def _to_bf16(word):
    """float32 bits -> bf16 bits: round to nearest even, NaN -> 0x7FC0 (torch's rule)."""
    rounded = np.uint32(word + np.uint32(0x7FFF) + np.uint32(np.uint32(word >> 16) & 1)) >> 16
    nan = np.uint32(word & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.uint16(0x7FC0) if nan else np.uint16(rounded)


def rerotate_kernel(
    k,  # [L, T, W] uint16 (bf16 bits) or uint32 (float32 bits), last dim contiguous
    cos,  # [T, R/2] float32
    sin,  # [T, R/2] float32
    head_size,
    rotary_dim,
    neox,  # 1: pairs (i, i + R/2); 0: pairs (2i, 2i + 1)
    shift,  # 16 for bf16 bits, 0 for float32 bits
):
    layers, tokens, width = k.shape
    half = rotary_dim // 2
    for row in range(layers * tokens):
        keys, c, s = k[row // tokens, row % tokens], cos[row % tokens], sin[row % tokens]
        for o in range(0, width, head_size):
            if neox:  # two contiguous runs (twice as fast as strided ones, measured)
                _rotate_pairs(keys[o : o + half], keys[o + half : o + rotary_dim], c, s, shift)
            else:
                _rotate_pairs(
                    keys[o : o + rotary_dim : 2], keys[o + 1 : o + rotary_dim : 2], c, s, shift
                )


def _rotate_pairs(first, second, c, s, shift):
    """Rotate the pairs ``(first[i], second[i])`` by the angle of ``(c[i], s[i])``."""
    for i in range(first.shape[0]):
        x1 = np.uint32(np.uint32(first[i]) << shift).view(np.float32)
        x2 = np.uint32(np.uint32(second[i]) << shift).view(np.float32)
        r1 = np.float32(np.float32(x1 * c[i]) - np.float32(x2 * s[i])).view(np.uint32)
        r2 = np.float32(np.float32(x2 * c[i]) + np.float32(x1 * s[i])).view(np.uint32)
        if shift:
            first[i], second[i] = _to_bf16(r1), _to_bf16(r2)
        else:
            first[i], second[i] = r1, r2


# Serial (see NumbaKernel): CacheBlend calls it from the engine's own thread.
NUMBA_KERNEL = NumbaKernel(
    rerotate_kernel, helpers=[_to_bf16, _rotate_pairs], op="rope_rerotate", parallel=False
)

_BITS = {torch.bfloat16: (torch.int16, np.uint16), torch.float32: (torch.int32, np.uint32)}


@NUMBA_KERNEL.falling_back_to(rerotate_torch)
def rerotate_numba(
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
    """The numba backend (arguments as :func:`kvtier_kernels.rope.rerotation.rerotate`, validated
    there); fp16 keys, which numba has no arithmetic for, go to the torch backend, and so
    does every call where numba fails to import or to compile the kernel (logged once)."""
    rotary_dim = head_size if rotary_dim is None else rotary_dim
    if k.dtype not in _BITS:
        return rerotate_torch(
            k,
            old_positions,
            new_positions,
            head_size=head_size,
            rotary_dim=rotary_dim,
            base=base,
            inv_freq=inv_freq,
            is_neox_style=is_neox_style,
        )
    if k.numel() == 0:
        return k
    cos, sin = rotation_cos_sin(k, old_positions, new_positions, rotary_dim, base, inv_freq)
    signed, unsigned = _BITS[k.dtype]
    shift = 16 if k.dtype == torch.bfloat16 else 0
    NUMBA_KERNEL(
        k.view(signed).numpy().view(unsigned),  # [L, T, H * D], shares k's memory
        cos[0, :, 0].contiguous().numpy(),  # [T, R/2]
        sin[0, :, 0].contiguous().numpy(),  # [T, R/2]
        head_size,
        rotary_dim,
        1 if is_neox_style else 0,
        shift,
        work=k.shape[0] * k.shape[1] * (k.shape[2] // head_size) * rotary_dim,
    )
    return k


registry.register("rope_rerotate", "numba", loader=numba_loader([NUMBA_KERNEL], rerotate_numba))
