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

import contextlib
import gc
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL_SHAPE = {
    "num_layers": 8,
    "num_heads": 16,
    "num_kv_heads": 4,
    "head_size": 64,
    "intermediate_size": 2816,
    "vocab_size": 8192,
}


def build_llama(
    path: Path,
    *,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    intermediate_size: int | None = None,
    vocab_size: int = 512,
    max_position_embeddings: int = 8192,
    seed: int = 0,
    weight_std: float | None = None,
) -> Path:
    """Write a random-weight bf16 Llama (safetensors + config.json) to ``path``, once.

    ``weight_std`` redraws every matrix from N(0, std): larger weights spread the logits,
    so greedy argmax is far from ties. The model is written beside ``path`` and renamed
    into place, so a half-written model is never reused.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

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
    if weight_std is not None:
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, weight_std)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(path)
    return path


def build_model(path: Path) -> Path:
    """The demo's model (``MODEL_SHAPE``) at ``path``."""
    return build_llama(path, **MODEL_SHAPE)


def transfer_config(extra: dict[str, Any], *, engine_id: str | None = None) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` enabling kvtier with ``extra`` as its config."""
    config: dict[str, Any] = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integration.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    if engine_id is not None:
        config["engine_id"] = engine_id
    return config


def make_engine(model: Path, *, max_model_len: int, kvtier: dict[str, Any] | None = None):
    """A bf16 ``vllm.LLM`` on the demo's settings; ``kvtier`` is the connector's config
    (None: no connector)."""
    from vllm import LLM

    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=1 << 30,
        block_size=32,
        max_model_len=max_model_len,
        enforce_eager=True,
        dtype="bfloat16",
        kv_transfer_config=None if kvtier is None else transfer_config(kvtier),
    )


def shutdown_engine(llm) -> None:
    """Stop an engine and its worker processes before the next one starts."""
    with contextlib.suppress(Exception):  # best effort; process exit cleans up too
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def run_vllm_demo(*, tokens: int = 4000, chunk_size: int = 256, max_tokens: int = 16) -> int:
    """Run the walk-through: cold prefill, a kvtier hit from memory, then a new engine
    process loading the prompt from kvtier's local disk tier. Returns 0 when both hits
    loaded tokens and every output matched a full recomputation."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the demo's output readable
    try:
        import vllm  # noqa: F401 - only checks that the engine is installed
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
    disk = tempfile.mkdtemp(prefix="kvtier-demo-disk-")
    kvtier = {"chunk_size": chunk_size, "max_local_cpu_size": 2, "local_disk": disk}
    rng = random.Random(0)
    prompt = [rng.randrange(1, MODEL_SHAPE["vocab_size"]) for _ in range(tokens)]
    try:
        return _demo_engines(model, prompt, kvtier, max_tokens)
    finally:
        shutil.rmtree(disk, ignore_errors=True)


def _demo_engines(model: Path, prompt: list[int], kvtier: dict[str, Any], max_tokens: int):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tokens = len(prompt)
    max_model_len = tokens + max_tokens + 64

    def serve(llm, n: int):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        return time.perf_counter() - start, list(out.outputs[0].token_ids), out.num_cached_tokens

    print("starting vLLM with --kv-transfer-config", transfer_config(kvtier))
    llm = make_engine(model, max_model_len=max_model_len, kvtier=kvtier)
    cold_ttft, cold_first, _ = serve(llm, 1)
    print(
        f"cold:    time to first token {cold_ttft:6.2f} s  (full prefill of {tokens} tokens; "
        "kvtier stored the prompt in memory and on disk)"
    )
    llm.reset_prefix_cache()  # vLLM forgets; kvtier keeps
    warm_ttft, warm_first, loaded = serve(llm, 1)
    print(
        f"warm:    time to first token {warm_ttft:6.2f} s  ({loaded} tokens loaded from "
        f"kvtier, {tokens - loaded} computed): {cold_ttft / warm_ttft:.1f}x faster"
    )
    llm.reset_prefix_cache()
    _, from_memory, _ = serve(llm, max_tokens)
    shutdown_engine(llm)

    print("restarting: a new engine process with the same local_disk")
    llm = make_engine(model, max_model_len=max_model_len, kvtier=kvtier)
    try:
        disk_ttft, disk_first, disk_loaded = serve(llm, 1)
        print(
            f"restart: time to first token {disk_ttft:6.2f} s  ({disk_loaded} tokens loaded "
            f"from kvtier's disk tier): {cold_ttft / disk_ttft:.1f}x faster than cold"
        )
        llm.reset_prefix_cache()
        _, from_disk, _ = serve(llm, max_tokens)
        llm.reset_prefix_cache(reset_connector=True)  # empty kvtier too: full recomputation
        _, recomputed, recomputed_loaded = serve(llm, max_tokens)
    finally:
        shutdown_engine(llm)
    same = (
        from_memory == from_disk == recomputed
        and cold_first == warm_first == disk_first
        and recomputed_loaded == 0
    )
    print(f"outputs ({max_tokens} greedy tokens): served from kvtier {from_memory}")
    print(f"                           after the restart {from_disk}")
    print(f"                           recomputed        {recomputed}")
    print("identical" if same else "MISMATCH")
    ok = same and loaded > 0 and disk_loaded > 0
    return 0 if ok else 1
