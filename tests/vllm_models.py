"""Tiny random-weight Llama checkpoints for real-engine tests (nothing is downloaded).

``make_tiny_llama(path, ...)`` writes a ``transformers`` Llama with random weights (fixed
seed) as safetensors plus its ``config.json``; vLLM loads it with
``skip_tokenizer_init=True`` and prompts given as token ids.
"""

from __future__ import annotations

from pathlib import Path


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
    """Write a random-weight Llama to ``path`` (once; an existing one is reused)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    hidden = num_heads * head_size
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate_size or 2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    # Larger-than-default weights make logits spread out, so greedy argmax is far from
    # ties and outputs are a sharp test of the KV a request attends to.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return path
