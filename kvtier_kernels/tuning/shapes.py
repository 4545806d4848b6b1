"""The KV geometry ``kvtier tune`` sweeps for: :class:`ModelShape`, read from a
HuggingFace-style ``config.json`` (:func:`model_shape_from_config`) or given field by
field. KV dtype names: :func:`kvtier_kernels.dtypes.parse_dtype`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier_kernels.dtypes import dtype_name, parse_dtype
from kvtier_kernels.layouts import get_layout

__all__ = ["ModelShape", "model_shape_from_config", "read_model_config"]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The KV geometry of one model as a serving engine's paged cache holds it.

    Attributes:
        num_layers, num_kv_heads, head_size: the cache's geometry (MLA: one head of the
            latent dim, e.g. 576).
        block_size: tokens per engine block.
        chunk_size: tokens per kvtier chunk (what one gather/scatter/RoPE launch moves).
        dtype: the KV cache dtype.
        layout: the engine layout name (``kvtier_kernels.layouts.LAYOUTS``).
        rotary_dim: dims of each head that RoPE rotates; None means ``head_size``; 0 means
            nothing to re-rotate (MLA, models without RoPE).
        name: a label for progress output.

    Raises:
        ValueError: a non-positive size, an unknown layout, MLA with more than one head, or
            a rotary dim that is odd or larger than the head.
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int = 16
    chunk_size: int = 256
    dtype: torch.dtype = torch.bfloat16
    layout: str = "vllm_nhd"
    rotary_dim: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size", "chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        layout = get_layout(self.layout)  # raises for an unknown name
        if layout.kv_planes == 1 and self.num_kv_heads != 1:
            raise ValueError(
                f"layout {self.layout!r} holds one latent head; num_kv_heads must be 1"
            )
        rotary = self.rotary_dim
        if rotary is not None and (rotary < 0 or rotary % 2 or rotary > self.head_size):
            raise ValueError(
                f"rotary_dim must be an even number in [0, head_size={self.head_size}]; got {rotary}"
            )

    @property
    def rope_dim(self) -> int:
        """Dims that RoPE rotates per head (0: no RoPE re-rotation for this model)."""
        return self.head_size if self.rotary_dim is None else self.rotary_dim

    def describe(self) -> str:
        label = f"{self.name}: " if self.name else ""
        return (
            f"{label}{self.num_layers} layers x {self.num_kv_heads} KV heads x {self.head_size}, "
            f"{dtype_name(self.dtype)}, block {self.block_size}, chunk {self.chunk_size}, "
            f"layout {self.layout}, rotary dim {self.rope_dim or 'none'}"
        )


def _first(config: Mapping[str, Any], *names: str) -> Any:
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return None


def read_model_config(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`ModelShape` fields a HuggingFace-style ``config.json`` determines.

    ``source`` is the file, a model directory holding ``config.json``, or the parsed dict.
    Reads ``num_hidden_layers``, ``num_key_value_heads`` (default: the attention heads;
    ``multi_query``: 1), ``head_dim`` (default ``hidden_size // num_attention_heads``),
    ``torch_dtype`` / ``dtype``, ``partial_rotary_factor`` / ``rotary_pct`` /
    ``rotary_dim``; a ``text_config`` (multimodal models) is used in place of the top
    level; MLA models (``kv_lora_rank``) get the ``mla`` layout, one head of
    ``kv_lora_rank + qk_rope_head_dim`` and no RoPE re-rotation.

    Raises:
        ValueError: unreadable, or a required field is missing (the message names it).
    """
    if isinstance(source, Mapping):
        config: Any = dict(source)
        where = "model config"
    else:
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        where = str(path)
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read model config {where}: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: expected a JSON object")
    text = config.get("text_config")
    if isinstance(text, dict):
        config = {**config, **text}

    fields: dict[str, Any] = {}
    name = _first(config, "_name_or_path", "model_type")
    if name:
        fields["name"] = str(name)
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    if layers is None:
        raise ValueError(f"{where}: no num_hidden_layers")
    fields["num_layers"] = int(layers)
    dtype = _first(config, "torch_dtype", "dtype")
    if isinstance(dtype, str):
        with contextlib.suppress(ValueError):  # e.g. "auto": --dtype or the default decides
            fields["dtype"] = parse_dtype(dtype)

    if config.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3): one latent plane
        fields.update(
            layout="mla",
            num_kv_heads=1,
            head_size=int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim") or 0),
            rotary_dim=0,
        )
        return fields

    heads = _first(config, "num_attention_heads", "n_head")
    if heads is None:
        raise ValueError(f"{where}: no num_attention_heads")
    kv_heads = _first(config, "num_key_value_heads", "num_kv_heads", "n_head_kv")
    if kv_heads is None:
        kv_heads = 1 if config.get("multi_query") else heads
    head_size = config.get("head_dim")
    if head_size is None:
        hidden = _first(config, "hidden_size", "n_embd", "d_model")
        if hidden is None:
            raise ValueError(f"{where}: no head_dim and no hidden_size")
        head_size = int(hidden) // int(heads)
    fields.update(num_kv_heads=int(kv_heads), head_size=int(head_size))
    rotary = config.get("rotary_dim")
    factor = _first(config, "partial_rotary_factor", "rotary_pct")
    if rotary is None and factor is not None:
        rotary = int(int(head_size) * float(factor))
    if rotary is not None:
        fields["rotary_dim"] = int(rotary) // 2 * 2
    return fields


def model_shape_from_config(source: str | Path | Mapping[str, Any], **overrides: Any) -> ModelShape:
    """A :class:`ModelShape` from a model config (:func:`read_model_config`), with
    ``overrides`` (ModelShape fields; None values are ignored) taking precedence."""
    fields = read_model_config(source)
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return ModelShape(**fields)
