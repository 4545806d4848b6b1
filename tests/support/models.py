"""Tiny random-weight Llama checkpoints for real-engine tests (nothing is downloaded).

``make_tiny_llama(path, ...)`` writes a ``transformers`` Llama with random weights (fixed
seed) as safetensors plus its ``config.json`` (``kvtier.demo_vllm.build_llama``); vLLM
loads it with ``skip_tokenizer_init=True`` and prompts given as token ids.
"""

from __future__ import annotations

from pathlib import Path

from kvtier.demo_vllm import build_llama


def make_tiny_llama(
    path: str | Path,
    *,
    num_layers: int = 2,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_size: int = 32,
    intermediate_size: int | None = None,
    vocab_size: int = 512,
    max_position_embeddings: int = 4096,
    seed: int = 0,
) -> Path:
    """Write a random-weight Llama to ``path`` (once; an existing one is reused).

    Weights are redrawn from N(0, 0.08) so logits spread out, greedy argmax is far from
    ties, and outputs are a sharp test of the KV a request attends to.
    """
    return build_llama(
        Path(path),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        seed=seed,
        weight_std=0.08,
    )
