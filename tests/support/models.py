"""Tiny random-weight checkpoints for real-engine tests (nothing is downloaded).

``make_tiny_llama(path, ...)`` writes a ``transformers`` Llama with random weights (fixed
seed) as safetensors plus its ``config.json`` (``kvtier.demo_vllm.build_llama``);
``make_tiny_mistral`` a sliding-window Mistral. vLLM loads them with
``skip_tokenizer_init=True`` and prompts given as token ids.
"""

from __future__ import annotations

import os
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


def make_tiny_mistral(path: str | Path, *, sliding_window: int, seed: int = 0) -> Path:
    """Write a random-weight Mistral whose every layer attends to the last
    ``sliding_window`` tokens (vLLM runs it as one sliding-window KV cache group) to
    ``path``, once; weights as ``make_tiny_llama``'s."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    config = MistralConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        sliding_window=sliding_window,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = MistralForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(path)
    return path


# A chat template that is plain text: each message's role and content, then the prompt
# for the assistant's turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} {{ message['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}"
)


def add_word_tokenizer(model: Path, vocab_size: int = 512) -> Path:
    """Give a local model a tokenizer and chat template of its own (nothing downloaded):
    one word per token, ``w0`` … ``w{vocab_size-1}``, the role names among them, so text
    and chat requests reach the engine. Returns ``model``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "system", "user", "assistant"]
    words += [f"w{i}" for i in range(len(words), vocab_size)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(str(model))
    return model
