"""What CacheBlend needs to know about a model, read from its HF config (never from a
list of model names): whether it can be blended at all, and its RoPE.

A model can be blended when every layer is full causal attention over RoPE-rotated keys
that kvtier can re-rotate: no MLA (latent KV, ``kv_lora_rank``), no sliding window, no
bidirectional attention (``is_causal: false``), no capped attention logits
(``attn_logit_softcapping``), no hybrid stack (``layer_types`` other than full attention, Mamba / linear-attention
layers), no scaling of the hidden states between a layer's modules (Granite's and
MiniCPM's multipliers) or of queries by position (``llama_4_scaling``), and a rope type
whose rotation is a pure function of ``position * inv_freq`` (``default``, ``linear``,
``llama3``, ``yarn``) over an even number of rotary dims. Anything else is refused with
:class:`UnsupportedModelError` naming the model class, never blended wrongly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvtier_kernels.rope import rope_inv_freq

__all__ = ["RopeSpec", "UnsupportedModelError", "check_blendable", "rope_spec"]

_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Config fields that scale the hidden states between a Llama decoder's modules (Granite,
# MiniCPM): the blend drives the modules and would leave them out.
_STREAM_SCALES = ("embedding_multiplier", "residual_multiplier", "scale_emb", "scale_depth")


class UnsupportedModelError(ValueError):
    """``enable_blending`` is on for a model CacheBlend cannot blend (the message names
    the model class and the reason)."""


def _model_class(hf_config: Any) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    return archs[0] if archs else type(hf_config).__name__


def _rope_parameters(hf_config: Any) -> dict[str, Any] | None:
    """The rope settings, from ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (older configs); None for a model without RoPE."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params:  # per layer type
        params = params["full_attention"]
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return dict(params)
    theta = getattr(hf_config, "rope_theta", None)
    if theta is None:
        return None
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    # NOTE: older configs name the rope type "type" (rope_scaling: {type: linear, ...})
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    return {**scaling, "rope_type": rope_type, "rope_theta": theta}


def check_blendable(hf_config: Any) -> None:
    """Raise :class:`UnsupportedModelError` unless CacheBlend can blend this model."""
    name = _model_class(hf_config)
    reasons = []
    if getattr(hf_config, "kv_lora_rank", None):
        reasons.append("it uses MLA (latent KV, kv_lora_rank)")
    if getattr(hf_config, "sliding_window", None) and getattr(
        hf_config, "use_sliding_window", True
    ):
        reasons.append(
            f"it uses sliding-window attention (sliding_window={hf_config.sliding_window})"
        )
    layer_types = set(getattr(hf_config, "layer_types", None) or ())
    if layer_types - {"full_attention"}:
        reasons.append(f"it is a hybrid model (layer types {sorted(layer_types)})")
    scaled = {
        name: getattr(hf_config, name)
        for name in _STREAM_SCALES
        if getattr(hf_config, name, None) not in (None, 1, 1.0)
    }
    if scaled:
        fields = ", ".join(f"{name}={value}" for name, value in scaled.items())
        reasons.append(f"it scales its embeddings or residual stream ({fields})")
    # NOTE: read as vLLM reads it (Qwen2's attention, the model config's attn_type)
    if not getattr(hf_config, "is_causal", True) or getattr(
        hf_config, "use_bidirectional_attention", False
    ):
        reasons.append(
            "its attention is bidirectional (is_causal: false), and the blend computes "
            "causal attention"
        )
    softcap = getattr(hf_config, "attn_logit_softcapping", None)
    if softcap:
        reasons.append(
            f"it caps its attention logits (attn_logit_softcapping={softcap}), and the "
            "blend's attention does not"
        )
    if getattr(hf_config, "llama_4_scaling", None):
        reasons.append("its attention scales queries by position (llama_4_scaling)")
    params = _rope_parameters(hf_config)
    if params is None:
        reasons.append("it does not use rotary position embeddings (RoPE)")
    elif params.get("rope_type", params.get("type", "default")) not in _ROPE_TYPES:
        rope_type = params.get("rope_type", params.get("type"))
        reasons.append(f"its rope type {rope_type!r} is not one of {', '.join(_ROPE_TYPES)}")
    else:
        head_size = _head_size(hf_config)
        rotary_dim = None if head_size is None else _rotary_dim(hf_config, params, head_size)
        if rotary_dim is not None and (rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_size):
            # NOTE: vLLM accepts an odd rotary dim; the re-rotation turns pairs of dims
            reasons.append(
                f"its rotary dims ({rotary_dim} of head size {head_size}) are not an even "
                "number in (0, head size], and the blend re-rotates keys by pairs of dims"
            )
    if reasons:
        raise UnsupportedModelError(
            f"enable_blending: CacheBlend cannot blend model class {name}: "
            + "; ".join(reasons)
            + ". Supported: decoders with full causal attention over RoPE keys (Llama, "
            "Mistral without sliding window, Qwen2/Qwen3, ...); set enable_blending: false"
        )


@dataclass(frozen=True)
class RopeSpec:
    """A model's RoPE as CacheBlend re-rotates it.

    Attributes:
        head_size: dims per head.
        rotary_dim: leading dims of each head that rotate.
        inv_freq: ``[rotary_dim // 2]`` fp32 frequencies (scaling applied).
        is_neox_style: NeoX pairing (``rotate_half``) if True, else GPT-J (interleaved).
    """

    head_size: int
    rotary_dim: int
    inv_freq: torch.Tensor
    is_neox_style: bool = True


def rope_spec(hf_config: Any) -> RopeSpec:
    """The RoPE of a blendable model (:func:`check_blendable` first), from its config:
    ``head_dim``, the rotary dims (``rope_dim``, else ``partial_rotary_factor``, as vLLM's
    ``get_rope`` reads them), ``rope_theta`` and rope scaling (linear,
    llama3, YaRN), with the NeoX pairing HF and vLLM use for these decoders unless the
    config says ``rope_is_neox_style: false`` / ``rotary_interleaved`` style."""
    check_blendable(hf_config)
    params = _rope_parameters(hf_config)
    head_size = _head_size(hf_config)
    assert params is not None and head_size is not None
    rotary_dim = _rotary_dim(hf_config, params, head_size)
    inv_freq = rope_inv_freq(rotary_dim, float(params["rope_theta"]))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, params)
    elif rope_type == "yarn":
        inv_freq = _yarn(rotary_dim, params, hf_config)
    neox = not (
        getattr(hf_config, "rotary_interleaved", False)
        or getattr(hf_config, "rope_is_neox_style", True) is False
    )
    return RopeSpec(head_size, rotary_dim, inv_freq.to(torch.float32), neox)


def _head_size(hf_config: Any) -> int | None:
    """Dims per head: ``head_dim``, else ``hidden_size / num_attention_heads``; None when
    the config gives neither."""
    head_dim = getattr(hf_config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    hidden, heads = (getattr(hf_config, n, None) for n in ("hidden_size", "num_attention_heads"))
    return hidden // heads if hidden and heads else None


def _rotary_dim(hf_config: Any, params: dict[str, Any], head_size: int) -> int:
    """The leading dims of each head that rotate, as vLLM's ``get_rope`` reads them: an
    explicit ``rope_dim`` wins over ``head_size * partial_rotary_factor``."""
    rotary_dim = params.get("rope_dim")
    if not rotary_dim:
        factor = params.get(
            "partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)
        )
        rotary_dim = head_size * (factor or 1.0)
    return int(rotary_dim)


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3's frequency scaling (as transformers' ``_compute_llama3_parameters``)."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_context = float(params["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rotary_dim: int, params: dict[str, Any], hf_config: Any) -> torch.Tensor:
    """YaRN's frequencies (as transformers' ``_compute_yarn_parameters``); its attention
    temperature scales cos/sin once when keys are made and does not affect re-rotation."""
    base = float(params["rope_theta"])
    factor = float(params["factor"])
    old_context = (
        params.get("original_max_position_embeddings") or hf_config.max_position_embeddings
    )
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(old_context / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).to(torch.float32) / rotary_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
