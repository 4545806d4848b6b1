"""CacheGen codec quality on realistic KV: the per-element bound, the relative error it
implies, error against the level count, and the compression ratio.

Data: K and V of real forward passes of random-weight ``transformers`` Llamas
(``support.samples.llama_kv``; K post-RoPE) over head sizes 64 and 128, 2/4/8 KV heads, 3-12
layers and 16/64/100/256 tokens, and synthetic KV with outlier K channels and an odd width.

Relative error from the bound. For one (plane, layer) with ``T`` tokens of ``D``
channels, token absmax ``scale_t`` and ``n`` levels, every element has
``|e| <= scale_t * (1/(2n) + 2**-20)``, so summing squares over ``T x D`` elements::

    ||e||_F / ||x||_F  <=  (1/(2n) + 2**-20) * crest,   crest = rms_t(scale_t) / rms(x)

``crest`` (absmax over rms) is 2.6-4.0 on these ``llama_kv`` samples and 5.3-18 on the
synthetic one, whose outlier channels set the scale of every K token. Rounding to the
nearest of the steps ``scale / n`` spreads the error uniformly over half a step either way
when the values cover many steps, which gives the expected figure ``crest / (n * sqrt(12))``,
sqrt(3) below the worst case. Measured: 0.988-1.025 of it on ``llama_kv`` (near-Gaussian
channels), 0.61-1.0 on the synthetic KV (most K channels sit within a step or two of zero
there, where the error is the value itself, less than uniform). At the default schedule
that is 0.052-0.063 at 16 levels and 0.092-0.146 at 8 levels on ``llama_kv``.

Compression at the default schedule (bitstream version 3, the Gaussian model chosen),
``llama_kv`` at 256 tokens: 4.48x (6 layers, head 64, 4 KV heads), 4.32x (4 layers, head
128, 2 KV heads) and 5.14x (12 layers, head 64, 8 KV heads) smaller than bf16 (version 2:
3.92x, 3.76x, 4.65x); a small model's 64-token chunk (4 layers, head 64, 2 KV heads):
3.77x (version 2: 2.62x).

Exact symbol round trips, rejection and the bound on small synthetic chunks are in
``test_cachegen.py``.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from support.samples import assert_within_bound, llama_kv, synthetic_kv

from kvtier_kernels.cachegen import decode_chunk, default_levels, encode_chunk

pytest.importorskip("transformers")

# name -> llama_kv arguments (num_heads / num_kv_heads: GQA 4:1, 2:1 and MHA)
LLAMA_SHAPES = {
    "llama-h64-kv2-L3-T16": dict(
        head_size=64, num_heads=8, num_kv_heads=2, num_layers=3, tokens=16
    ),
    "llama-h64-kv2-L4-T64": dict(
        head_size=64, num_heads=4, num_kv_heads=2, num_layers=4, tokens=64
    ),
    "llama-h128-kv8-L12-T100": dict(
        head_size=128, num_heads=8, num_kv_heads=8, num_layers=12, tokens=100
    ),
    "llama-h64-kv4-L6-T256": dict(
        head_size=64, num_heads=16, num_kv_heads=4, num_layers=6, tokens=256
    ),
    "llama-h128-kv2-L4-T256": dict(
        head_size=128, num_heads=8, num_kv_heads=2, num_layers=4, tokens=256
    ),
    "llama-h64-kv8-L12-T256": dict(
        head_size=64, num_heads=8, num_kv_heads=8, num_layers=12, tokens=256
    ),
}
# outliers: 4 K channels 15x the others; 576 channels, 200 tokens
SYNTHETIC = {"synthetic-outliers-L6-T200-D576": dict(layers=6, tokens=200, hidden=576, seed=4)}
SOURCES = [*LLAMA_SHAPES, *SYNTHETIC]
SCHEDULES = ["default", "k32-v4"]

# The uniform-rounding estimate holds to a few percent on llama_kv (see the docstring);
# 10% is several standard deviations of that estimate on the smallest plane (2048 values).
UNIFORM_ESTIMATE_SLACK = 1.10
# the smallest ratio over bf16 at the default schedule, by chunk size (issue 14's targets:
# 3.5x from 64 tokens up on small models; the Llama shapes measure 4.3-5.1x at 256)
DEFAULT_RATIO_BF16 = {64: 3.5, 256: 4.0}


@functools.cache
def kv(source: str) -> torch.Tensor:
    """``[2, L, T, D]`` bf16, generated once per session."""
    if source in LLAMA_SHAPES:
        return llama_kv(**LLAMA_SHAPES[source])
    return synthetic_kv(**SYNTHETIC[source])


def levels_of(schedule: str, num_layers: int) -> dict[str, list[int]]:
    if schedule == "default":
        return {}
    if schedule == "k32-v4":
        return {"k_levels": [32] * num_layers, "v_levels": [4] * num_layers}
    raise ValueError(schedule)


@functools.cache
def encoded(source: str, schedule: str) -> tuple[bytes, dict]:
    chunk = kv(source)
    return encode_chunk(chunk, **levels_of(schedule, chunk.shape[1]))


def decoded(source: str, schedule: str, out_dtype: torch.dtype = torch.float32):
    payload, params = encoded(source, schedule)
    out = torch.empty(kv(source).shape, dtype=out_dtype)
    decode_chunk(payload, params, out)
    return out, params


def relative_errors(chunk: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``||x - x_hat||_F / ||x||_F`` per (plane, layer), ``[2, L]``."""
    x = chunk.float()
    return (out.float() - x).norm(dim=(-2, -1)) / x.norm(dim=(-2, -1))


def crest_factors(chunk: torch.Tensor) -> torch.Tensor:
    """rms over tokens of the token absmax / rms of the values, per (plane, layer)."""
    x = chunk.float()
    scale = x.abs().amax(-1)  # [2, L, T]
    return scale.pow(2).mean(-1).sqrt() / x.pow(2).mean((-2, -1)).sqrt()


def fmt(values: torch.Tensor) -> str:
    return " ".join(f"{v:.3f}" for v in values.tolist())


def levels_tensor(params: dict) -> torch.Tensor:
    return torch.tensor([params["k_levels"], params["v_levels"]], dtype=torch.float32)


def assert_each_plane_layer(ok: torch.Tensor, message) -> None:
    """Fail naming the first (plane, layer) where ``ok`` is False; ``message(kv, layer)``
    says what was wrong there."""
    for plane, layer in (~ok).nonzero().tolist():
        pytest.fail(f"{'KV'[plane]} layer {layer}: {message(plane, layer)}")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("source", SOURCES)
def test_error_within_bound_per_layer_and_plane(source, schedule, out_dtype):
    out, params = decoded(source, schedule, out_dtype)
    assert_within_bound(kv(source), out, params)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("source", SOURCES)
def test_relative_error_follows_from_the_bound(source, schedule):
    chunk = kv(source)
    out, params = decoded(source, schedule)
    n = levels_tensor(params)
    rel, crest = relative_errors(chunk, out), crest_factors(chunk)
    worst = crest * (1 / (2 * n) + 2.0**-20)
    uniform = crest / (n * math.sqrt(12))
    print(
        f"\n{source} {schedule}: relative error K {fmt(rel[0])} V {fmt(rel[1])};"
        f" / uniform estimate {(rel / uniform).min():.3f}..{(rel / uniform).max():.3f}"
    )

    def why(plane, layer):
        return (
            f"relative error {rel[plane, layer]:.4f} (n={int(n[plane, layer])}, crest "
            f"{crest[plane, layer]:.2f}): worst case {worst[plane, layer]:.4f}, uniform "
            f"rounding estimate {uniform[plane, layer]:.4f}"
        )

    assert_each_plane_layer(rel <= worst, why)
    assert_each_plane_layer(rel <= UNIFORM_ESTIMATE_SLACK * uniform, why)
    if source in LLAMA_SHAPES:  # channels spread over many steps: rounding is uniform
        assert_each_plane_layer(rel >= uniform / UNIFORM_ESTIMATE_SLACK, why)


@pytest.mark.parametrize("source", ["llama-h64-kv2-L3-T16", "llama-h64-kv4-L6-T256", *SYNTHETIC])
def test_more_levels_give_strictly_smaller_error(source):
    chunk = kv(source)
    num_layers = chunk.shape[1]
    ladder = [1, 2, 4, 8, 16, 32, 64, 127]
    errors = []
    for n in ladder:
        payload, params = encode_chunk(chunk, k_levels=[n] * num_layers, v_levels=[n] * num_layers)
        out = torch.empty(chunk.shape)
        decode_chunk(payload, params, out)
        errors.append(relative_errors(chunk, out))
    errors = torch.stack(errors)  # [rungs, 2, L]
    for rung, plane, layer in (errors[1:] >= errors[:-1]).nonzero().tolist():
        pytest.fail(
            f"{'KV'[plane]} layer {layer}: {ladder[rung + 1]} levels give relative error "
            f"{errors[rung + 1, plane, layer]:.4g}, not below {errors[rung, plane, layer]:.4g} "
            f"at {ladder[rung]} levels"
        )
    worst = ", ".join(f"{n}: {e:.4f}" for n, e in zip(ladder, errors.amax((1, 2)), strict=True))
    print(f"\n{source}: worst relative error over planes and layers by levels: {worst}")


@pytest.mark.parametrize(
    "source", [s for s, a in LLAMA_SHAPES.items() if a["tokens"] in DEFAULT_RATIO_BF16]
)
def test_default_schedule_ratio_over_bf16(source):
    chunk = kv(source)
    payload, params = encoded(source, "default")
    assert (params["k_levels"], params["v_levels"]) == default_levels(chunk.shape[1])
    ratio = chunk.numel() * 2 / len(payload)
    print(f"\n{source}: default schedule {ratio:.2f}x smaller than bf16 ({params['model']})")
    minimum = DEFAULT_RATIO_BF16[chunk.shape[2]]
    assert ratio >= minimum, f"{ratio:.2f}x smaller than bf16, expected at least {minimum}x"
