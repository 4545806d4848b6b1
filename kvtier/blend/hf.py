"""A HF transformers decoder (``LlamaModel``-shaped: Llama, Mistral, Qwen2/3) as a
:class:`~kvtier.blend.blender.BlendModel`, driving the model's own modules (no copy of
its weights). It is the reference the blender is checked against on a CPU, and the way
to blend for a transformers model outside vLLM. Nothing here imports transformers: the
model's modules are duck-typed.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HFDecoder"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class HFDecoder:
    """``model``: the decoder stack (``LlamaModel``, i.e. ``LlamaForCausalLM.model``)."""

    def __init__(self, model: Any):
        config = model.config
        self.model = model
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_size = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.scale = model.layers[0].self_attn.scaling

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def layer_qkv(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor):
        block = self.model.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(hidden)
        n, d = x.shape[0], self.head_size
        q = attn.q_proj(x).view(n, -1, d)
        k = attn.k_proj(x).view(n, -1, d)
        v = attn.v_proj(x)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = self.model.rotary_emb(x[None], positions[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]
        rotary = cos.shape[-1]
        q = torch.cat(
            [q[..., :rotary] * cos + _rotate_half(q[..., :rotary]) * sin, q[..., rotary:]], -1
        )
        k = torch.cat(
            [k[..., :rotary] * cos + _rotate_half(k[..., :rotary]) * sin, k[..., rotary:]], -1
        )
        return q.reshape(n, -1), k.reshape(n, -1), v

    def layer_output(self, layer: int, hidden: torch.Tensor, attention: torch.Tensor):
        block = self.model.layers[layer]
        hidden = hidden + block.self_attn.o_proj(attention)
        return hidden + block.mlp(block.post_attention_layernorm(hidden))
