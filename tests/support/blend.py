"""Helpers of the CacheBlend tests: a tiny random transformers Llama on the CPU (float32,
nothing downloaded), its full-prefill KV, and prompts made of separated documents."""

from __future__ import annotations

import random

import torch


def tiny_hf_llama(
    *,
    num_layers: int = 4,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_size: int = 32,
    vocab_size: int = 512,
    seed: int = 0,
    **config: object,
):
    """A random-weight ``LlamaModel`` (weights N(0, 0.08), like the engine tests' model)."""
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=num_heads * head_size,
        intermediate_size=2 * num_heads * head_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_size,
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        attn_implementation="eager",
        **config,
    )
    model = LlamaModel(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.08)
    return model


@torch.inference_mode()
def full_kv(model, token_ids: list[int]) -> torch.Tensor:
    """``[2, L, T, Hkv * D]``: the KV of a full prefill of ``token_ids`` by ``model``."""
    out = model(torch.tensor([token_ids]), use_cache=True)
    cache = out.past_key_values
    planes = []
    for layer in cache.layers:
        k, v = layer.keys[0], layer.values[0]  # [Hkv, T, D]
        planes.append(torch.stack([k.transpose(0, 1).flatten(1), v.transpose(0, 1).flatten(1)]))
    return torch.stack(planes, dim=1)


def documents(count: int, length: int, *, seed: int = 0, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


def join(pieces: list[list[int]], separator: list[int]) -> tuple[list[int], list[int]]:
    """``pieces`` joined by ``separator``; returns the tokens and each piece's start."""
    tokens: list[int] = []
    starts = []
    for i, piece in enumerate(pieces):
        if i:
            tokens += separator
        starts.append(len(tokens))
        tokens += piece
    return tokens, starts


@torch.inference_mode()
def blended_greedy(
    model_dir,
    stored: list[int],
    prompt: list[int],
    separator: list[int],
    ratio: float,
    *,
    min_tokens: int,
    max_tokens: int,
) -> list[int]:
    """Greedy tokens of ``prompt`` when kvtier.blend (over transformers' Llama of
    ``model_dir``, float32) blends all but its last token from the segments of
    ``stored`` (check layer 0, ``ratio``): what a blending engine should produce."""
    from transformers import DynamicCache, LlamaForCausalLM

    from kvtier.blend import PlacedSegment, blend, place_segments, rope_spec
    from kvtier.blend.hf import HFDecoder
    from kvtier.blend.segments import split_segments

    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    decoder = HFDecoder(model.model)
    total = len(prompt) - 1
    old = {tuple(stored[s.start : s.end]): s for s in split_segments(stored, separator, 0)}
    stored_kv = full_kv(model, stored)
    width = decoder.num_kv_heads * decoder.head_size
    kv = torch.zeros(2, decoder.num_layers, total, width)
    reused = torch.zeros(total, dtype=torch.bool)
    placed = []
    for segment in split_segments(prompt, separator, min_tokens, end=total):
        source = old.get(tuple(prompt[segment.start : segment.end]))
        if source is not None and segment.end <= total:
            placed.append(
                PlacedSegment(
                    stored_kv[:, :, source.start : source.end].clone(),
                    torch.arange(source.start, source.end),
                    segment.start,
                )
            )
    place_segments(kv, reused, placed, rope_spec(model.config))
    kv = blend(decoder, torch.tensor(prompt[:total]), kv, reused, [(0, ratio)]).kv
    cache = DynamicCache()
    for layer in range(decoder.num_layers):
        planes = [
            kv[i, layer].view(total, decoder.num_kv_heads, -1).transpose(0, 1)[None] for i in (0, 1)
        ]
        cache.update(planes[0], planes[1], layer)
    token, position, out = prompt[total], total, []
    for _ in range(max_tokens):
        logits = model(
            torch.tensor([[token]]),
            position_ids=torch.tensor([[position]]),
            past_key_values=cache,
            use_cache=True,
        ).logits
        token, position = int(logits[0, -1].argmax()), position + 1
        out.append(token)
    return out
