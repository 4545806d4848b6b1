"""CacheBlend's computation: blend cached segment KV into one prompt's KV.

Input: a prompt's tokens and, for some of them, KV reused from elsewhere (cached
segments, already re-rotated to this prompt's positions by :func:`place_segments`)::

    tokens      | sys prompt |sep| doc B (cached) |sep| doc A (cached) |sep| question |
    kind          fresh       fresh  reused           fresh  reused         fresh
    layers < c    every fresh and reused token computed from scratch
    check layer c fresh K/V of every token; deviation |K - K_reused|^2 + |V - V_reused|^2
                  per reused token -> keep the top ``ratio`` of reused tokens + all fresh
    layers > c    only the kept tokens are computed (their K/V replace the reused ones);
                  their queries attend over the whole blended cache (causal by position)

``fixed`` tokens (already in the engine with exact KV, e.g. vLLM's own prefix hit) are
read, never recomputed. At ratio 1.0 every token is computed through every layer: the
result is a full prefill's KV (up to the float rounding of the attention kernel). At
ratio 0 reused tokens keep their reused KV past the check layer(s).

The model is reached through :class:`BlendModel`: embedding, a layer's Q/K/V (norm,
projection, the model's own RoPE) and a layer's output (output projection, residual, MLP).
kvtier computes the attention itself (scaled dot product, GQA, causal by position).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvtier.blend.model_spec import RopeSpec
from kvtier_kernels.rope import rerotate

__all__ = [
    "BlendModel",
    "BlendResult",
    "PlacedSegment",
    "blend",
    "check_rerotation",
    "place_segments",
]

_QUERY_BLOCK = 32  # queries per attention block: fewer keys computed past a query


class BlendModel(Protocol):
    """A decoder's layers as CacheBlend drives them (no second copy of the weights)."""

    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_size: int
    scale: float  # attention softmax scale

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, hidden]`` hidden states entering layer 0."""

    def layer_qkv(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q ``[T, Hq * D]``, K and V ``[T, Hkv * D]`` of ``hidden`` entering ``layer``,
        keys and queries rotated for ``positions`` by the model's own RoPE."""

    def layer_output(
        self, layer: int, hidden: torch.Tensor, attention: torch.Tensor
    ) -> torch.Tensor:
        """Hidden states leaving ``layer``, from those entering it and the attention
        output ``[T, Hq * D]`` (before the output projection)."""


@dataclass(frozen=True, slots=True)
class PlacedSegment:
    """A cached segment's KV and where it goes.

    Attributes:
        kv: ``[2, num_layers, n, Hkv * D]``, keys rotated for ``old_positions``.
        old_positions: ``[n]`` int64, the positions the KV was computed at.
        start: where the segment starts in the new prompt (it covers ``[start, start+n)``).
    """

    kv: torch.Tensor
    old_positions: torch.Tensor
    start: int


@dataclass(slots=True)
class BlendResult:
    """What one blend did.

    Attributes:
        kv: ``[2, num_layers, T, Hkv * D]``, the blended KV of the prompt.
        recomputed: ``[T]`` bool, tokens computed through every layer.
        deviation: check layer -> ``[T]`` fp32 KV deviation of each reused token there
            (0 elsewhere).
        seconds: wall time of the computation.
    """

    kv: torch.Tensor
    recomputed: torch.Tensor
    deviation: dict[int, torch.Tensor] = field(default_factory=dict)
    seconds: float = 0.0


def place_segments(
    kv: torch.Tensor,
    reused: torch.Tensor,
    segments: Sequence[PlacedSegment],
    rope: RopeSpec | None,
    *,
    backend: str = "auto",
) -> float:
    """Copy each segment's KV into ``kv`` (``[2, L, T, Hkv * D]``) at its new place, its
    keys re-rotated to the new positions (the registry's ``rope_rerotate``; ``rope`` None:
    not re-rotated, the baseline of reuse without CacheBlend), and mark ``reused``.
    Returns the seconds spent re-rotating."""
    rotate_seconds = 0.0
    for segment in segments:
        n = segment.kv.shape[2]
        end = segment.start + n
        kv[:, :, segment.start : end] = segment.kv.to(kv.dtype)
        reused[segment.start : end] = True
        if rope is not None:
            new_positions = torch.arange(segment.start, end, dtype=torch.int64)
            began = time.perf_counter()
            rerotate(
                kv[0, :, segment.start : end],
                segment.old_positions.to(torch.int64),
                new_positions,
                head_size=rope.head_size,
                rotary_dim=rope.rotary_dim,
                inv_freq=rope.inv_freq,
                is_neox_style=rope.is_neox_style,
                backend=backend,
            )
            rotate_seconds += time.perf_counter() - began
    return rotate_seconds


@torch.inference_mode()
def check_rerotation(model: BlendModel, rope: RopeSpec, max_position: int) -> float:
    """How far ``rope`` re-rotates the model's own keys from where they were made: layer
    0's keys of a few tokens made at positions ``0..n-1``, re-rotated to positions spread
    up to ``max_position``, against the keys the model makes there (squared error relative
    to their squared norm; 1e-10 or less in float32 and about 1e-5 in bfloat16 when
    ``rope`` is the model's RoPE, of order 1 when its rotary dims, pairing, base or scaling
    differ).
    """
    n = 8
    tokens = torch.arange(1, n + 1, dtype=torch.int64)
    old = torch.arange(n, dtype=torch.int64)
    new = torch.linspace(n, max(max_position - 1, 2 * n), n).to(torch.int64)
    hidden = model.embed(tokens)
    _, made_old, _ = model.layer_qkv(0, hidden, old)
    _, made_new, _ = model.layer_qkv(0, hidden, new)
    keys = made_old.float().clone()[None]
    rerotate(
        keys,
        old,
        new,
        head_size=rope.head_size,
        rotary_dim=rope.rotary_dim,
        inv_freq=rope.inv_freq,
        is_neox_style=rope.is_neox_style,
    )
    expected = made_new.float()[None]
    return float((keys - expected).pow(2).sum() / expected.pow(2).sum().clamp(min=1e-30))


def _attention(
    model: BlendModel,
    q: torch.Tensor,  # [n, Hq * D]
    keys: torch.Tensor,  # [T, Hkv * D]
    values: torch.Tensor,  # [T, Hkv * D]
    query_positions: torch.Tensor,  # [n] int64, increasing
) -> torch.Tensor:
    """Causal attention of ``n`` queries over the first ``T`` cached tokens -> ``[n, Hq * D]``.

    Blocks of ``_QUERY_BLOCK`` queries, each over the keys up to its last query; a block's
    query heads of one KV head are the rows of one matrix product (no repeated K/V for
    GQA), and only the keys past its first query are masked. Every query sees key 0, so
    no row is fully masked. Half-precision inputs are computed in float32.
    """
    d, hq, hkv = model.head_size, model.num_heads, model.num_kv_heads
    group = hq // hkv
    n, total = q.shape[0], keys.shape[0]
    dtype = torch.promote_types(q.dtype, torch.float32)
    keys_t = keys.to(dtype).view(total, hkv, d).permute(1, 2, 0).contiguous()  # [Hkv, D, T]
    values = values.to(dtype).view(total, hkv, d).transpose(0, 1).contiguous()  # [Hkv, T, D]
    out = torch.empty(n, hq * d, dtype=dtype)
    for start in range(0, n, _QUERY_BLOCK):
        positions = query_positions[start : start + _QUERY_BLOCK]
        rows = positions.shape[0]
        first, limit = int(positions[0]), int(positions[-1]) + 1
        block = q[start : start + rows].to(dtype) * model.scale
        block = block.view(rows, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * rows, d)
        scores = torch.bmm(block, keys_t[:, :, :limit])  # [Hkv, group * rows, limit]
        if first + 1 < limit:
            tail = scores.view(hkv, group, rows, limit)[..., first + 1 :]
            later = torch.arange(first + 1, limit)[None, :] > positions[:, None]
            tail.masked_fill_(later, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        heads = torch.bmm(probs, values[:, :limit])  # [Hkv, group * rows, D]
        out[start : start + rows] = heads.view(hkv, group, rows, d).permute(2, 0, 1, 3).flatten(1)
    return out.to(q.dtype)


@torch.inference_mode()
def blend(
    model: BlendModel,
    token_ids: torch.Tensor,  # [T]
    kv: torch.Tensor,  # [2, L, T, Hkv * D]: reused and fixed rows filled, filled in place
    reused: torch.Tensor,  # [T] bool
    schedule: Sequence[tuple[int, float]],  # (check layer, ratio of reused tokens kept)
    *,
    fixed: torch.Tensor | None = None,  # [T] bool: exact KV already in kv, never computed
) -> BlendResult:
    """Blend the prompt's KV in place (see the module docstring); returns ``kv`` and what
    was recomputed.

    Raises:
        ValueError: a check layer past the model's layers, or tensors of the wrong shape.
    """
    began = time.perf_counter()
    num_tokens = token_ids.shape[0]
    width = model.num_kv_heads * model.head_size
    if tuple(kv.shape) != (2, model.num_layers, num_tokens, width):
        raise ValueError(
            f"kv must be [2, num_layers, T, Hkv * D] = {(2, model.num_layers, num_tokens, width)}; "
            f"got {tuple(kv.shape)}"
        )
    checks = dict(schedule)
    if checks and max(checks) >= model.num_layers:
        raise ValueError(
            f"blend_check_layers {sorted(checks)} must be < the model's {model.num_layers} layers"
        )
    fixed = torch.zeros(num_tokens, dtype=torch.bool) if fixed is None else fixed
    reused = reused & ~fixed
    fresh = ~reused & ~fixed
    total_reused = int(reused.sum())
    active = torch.nonzero(~fixed).flatten()  # tokens whose hidden states are carried
    positions = torch.arange(num_tokens, dtype=torch.int64)
    hidden = model.embed(token_ids[active])
    deviation: dict[int, torch.Tensor] = {}
    for layer in range(model.num_layers):
        if active.numel() == 0:
            break  # every token keeps the KV it has (reused or fixed) from here on
        q, k, v = model.layer_qkv(layer, hidden, positions[active])
        if layer in checks:
            old = kv[:, layer, active].to(torch.float32)
            dev = ((k.float() - old[0]) ** 2).sum(-1) + ((v.float() - old[1]) ** 2).sum(-1)
            dev = torch.where(reused[active], dev, torch.zeros_like(dev))
            deviation[layer] = torch.zeros(num_tokens).index_put_((active,), dev)
            keep_reused = min(math.ceil(checks[layer] * total_reused), total_reused)
            candidates = torch.nonzero(reused[active]).flatten()
            top = dev[candidates].topk(min(keep_reused, candidates.numel())).indices
            keep = fresh[active].clone()
            keep[candidates[top]] = True
            # At the check layer every active token's K/V is fresh; only the kept go on.
            kv[0, layer, active] = k.to(kv.dtype)
            kv[1, layer, active] = v.to(kv.dtype)
            active, hidden, q = active[keep], hidden[keep], q[keep]
        else:
            kv[0, layer, active] = k.to(kv.dtype)
            kv[1, layer, active] = v.to(kv.dtype)
        attention = _attention(model, q, kv[0, layer], kv[1, layer], positions[active])
        hidden = model.layer_output(layer, hidden, attention)
    recomputed = torch.zeros(num_tokens, dtype=torch.bool)
    recomputed[active] = True
    return BlendResult(kv, recomputed, deviation, time.perf_counter() - began)
