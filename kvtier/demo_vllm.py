"""``kvtier demo``: kvtier inside a real vLLM engine, cold prefill vs a kvtier hit.

1. A random-weight Llama (no download: built locally with ``transformers`` and cached in
   the temp dir) big enough that prefill dominates on a CPU.
2. A vLLM engine with ``KVTierConnector`` serves a long prompt cold: full prefill, and
   kvtier stores the prompt's KV chunk by chunk.
3. vLLM's own prefix cache is reset, so the next request cannot hit it: the same prompt
   is served again and its KV is loaded from kvtier instead of recomputed.
4. The outputs of a kvtier hit and of a full recomputation (kvtier emptied too) are
   compared token for token.

Time to first token is the wall time of a one-token generation.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from pathlib import Path

MODEL_SHAPE = {
    "num_layers": 8,
    "num_heads": 16,
    "num_kv_heads": 4,
    "head_size": 64,
    "intermediate_size": 2816,
    "vocab_size": 8192,
}


def build_model(path: Path) -> Path:
    """A random-weight bf16 Llama at ``path`` (built once, then reused)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return path
    hidden = MODEL_SHAPE["num_heads"] * MODEL_SHAPE["head_size"]
    config = LlamaConfig(
        vocab_size=MODEL_SHAPE["vocab_size"],
        hidden_size=hidden,
        intermediate_size=MODEL_SHAPE["intermediate_size"],
        num_hidden_layers=MODEL_SHAPE["num_layers"],
        num_attention_heads=MODEL_SHAPE["num_heads"],
        num_key_value_heads=MODEL_SHAPE["num_kv_heads"],
        head_dim=MODEL_SHAPE["head_size"],
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(path)  # atomic: a half-written model is never reused
    return path


def run_vllm_demo(*, tokens: int = 4000, chunk_size: int = 256, max_tokens: int = 16) -> int:
    """Run the walk-through; returns 0 when the kvtier hit loaded tokens and the outputs
    matched a full recomputation."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the demo's output readable
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as error:
        print(
            f"kvtier demo needs vLLM ({error}); `make demo` installs it, or run "
            "`kvtier demo --synthetic` for the engine-free walk-through"
        )
        return 1

    model = build_model(Path(tempfile.gettempdir()) / "kvtier-demo-llama-v1")
    print(
        f"model: random-weight Llama, {MODEL_SHAPE['num_layers']} layers, "
        f"{MODEL_SHAPE['num_heads']} heads ({MODEL_SHAPE['num_kv_heads']} KV), "
        f"head size {MODEL_SHAPE['head_size']}, bf16, at {model}"
    )
    transfer = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integration.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"chunk_size": chunk_size, "max_local_cpu_size": 2},
    }
    print("starting vLLM with --kv-transfer-config", transfer)
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=1 << 30,
        block_size=32,
        max_model_len=tokens + max_tokens + 64,
        enforce_eager=True,
        dtype="bfloat16",
        kv_transfer_config=transfer,
    )
    rng = random.Random(0)
    prompt = [rng.randrange(1, MODEL_SHAPE["vocab_size"]) for _ in range(tokens)]

    def serve(n: int):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        return time.perf_counter() - start, list(out.outputs[0].token_ids), out.num_cached_tokens

    cold_ttft, cold_first, _ = serve(1)
    print(
        f"cold:  time to first token {cold_ttft:6.2f} s  (full prefill of {tokens} tokens; "
        "kvtier stored the prompt)"
    )
    llm.reset_prefix_cache()  # vLLM forgets; kvtier keeps
    warm_ttft, warm_first, loaded = serve(1)
    print(
        f"warm:  time to first token {warm_ttft:6.2f} s  ({loaded} tokens loaded from kvtier, "
        f"{tokens - loaded} computed)"
    )
    print(f"       {cold_ttft / warm_ttft:.1f}x faster to the first token")

    llm.reset_prefix_cache()
    _, from_kvtier, _ = serve(max_tokens)
    llm.reset_prefix_cache(reset_connector=True)  # empty kvtier too: a full recomputation
    _, recomputed, recomputed_loaded = serve(max_tokens)
    same = from_kvtier == recomputed and warm_first == cold_first and recomputed_loaded == 0
    print(f"outputs ({max_tokens} greedy tokens): served from kvtier {from_kvtier}")
    print(f"                           recomputed       {recomputed}")
    print("identical" if same else "MISMATCH")
    ok = same and loaded > 0
    return 0 if ok else 1
