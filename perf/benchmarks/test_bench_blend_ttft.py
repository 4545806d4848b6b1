"""CacheBlend in a real vLLM engine (CPU build): time to first token of a prompt whose four
1k-token documents were cached by an earlier prompt in another order, blended at ratio
0.15 through kvtier's connector, against the cold prefill of a prompt of the same shape in
the same engine and run.

Each round draws four new documents and serves, in one engine with blending on:

1. ``cold``: system prompt A, the documents in order 1-2-3-4, question A: nothing of it is
   cached anywhere (new system prompt, new documents), so it is a full prefill; kvtier
   stores its segments on the way (the cost of a miss with blending on is in it);
2. ``blend``: system prompt B, the documents in order 4-2-1-3, question B: vLLM's prefix
   cache holds none of it (its first block differs), kvtier claims all but the last token
   and computes their KV by blending the cached documents.

TTFT is the wall time of a one-token greedy generation. One untimed round first (every
path warmed up), then ``ROUNDS`` timed rounds; the figure is the median per mode. The
model is a random-weight Llama of 8 layers (hidden 512, 2 KV heads, head size 64) in
float32, written locally; the engine computes on this machine's cores, so the absolute
times are the CPU's, and the ratio is what carries over.
"""

from __future__ import annotations

import random
import statistics
import time

import pytest
from support.engines import generate, make_llm, shutdown, worker_stats
from support.models import add_word_tokenizer, make_tiny_llama

pytest.importorskip("vllm")

RESULTS_NAME = "blend"
DOCS, DOC_TOKENS, SYSTEM_TOKENS, QUESTION_TOKENS = 4, 1024, 48, 100
SEP_TEXT, SEP = " w7 w7 ", [7, 7]  # the word tokenizer: token 7 twice
RATIO = 0.15
ROUNDS = 3
ENGINE_ID = "kvtier-bench-blend-ttft"


def _words(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(8, 500) for _ in range(n)]


def _prompt(system: list[int], docs: list[list[int]], question: list[int]) -> list[int]:
    out = list(system)
    for doc in docs:
        out += [*SEP, *doc]
    return [*out, *SEP, *question]


def _ttft(llm, prompt: list[int]) -> tuple[float, int]:
    began = time.perf_counter()
    (result,) = generate(llm, [prompt], max_tokens=1)
    return time.perf_counter() - began, result.num_cached_tokens


def test_blend_ttft_in_vllm(record, tmp_path_factory):
    model = make_tiny_llama(
        tmp_path_factory.mktemp("models") / "llama-blend-ttft",
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        head_size=64,
        max_position_embeddings=8192,
    )
    add_word_tokenizer(model)
    extra = {
        "chunk_size": 256,
        "max_local_cpu_size": 1,
        "enable_blending": True,
        "blend_special_str": SEP_TEXT,
        "blend_recompute_ratios": [RATIO],
        "blend_min_tokens": 32,
    }
    length = SYSTEM_TOKENS + DOCS * (DOC_TOKENS + len(SEP)) + len(SEP) + QUESTION_TOKENS
    llm = make_llm(model, kvtier=extra, engine_id=ENGINE_ID, max_model_len=length + 64)
    rng = random.Random(22)
    times: dict[str, list[float]] = {"cold": [], "blend": []}
    claimed: list[int] = []
    try:
        for round_ in range(ROUNDS + 1):
            docs = [_words(DOC_TOKENS, rng) for _ in range(DOCS)]
            cold = _prompt(_words(SYSTEM_TOKENS, rng), docs, _words(QUESTION_TOKENS, rng))
            order = [docs[3], docs[1], docs[0], docs[2]]
            blended = _prompt(_words(SYSTEM_TOKENS, rng), order, _words(QUESTION_TOKENS, rng))
            cold_s, cold_cached = _ttft(llm, cold)
            blend_s, blend_cached = _ttft(llm, blended)
            assert cold_cached == 0, "the cold prompt must be a full prefill"
            assert blend_cached == len(blended) - 1, "the blend claims all but the last token"
            if round_:  # the first round warms every path up
                times["cold"].append(cold_s)
                times["blend"].append(blend_s)
                claimed.append(blend_cached)
        stats = worker_stats(ENGINE_ID)
    finally:
        shutdown(llm)
    requests = stats["blend_requests"]
    assert requests == ROUNDS + 1
    # kvtier's blend computation per request (the warm-up round included), and its RoPE part
    compute_ms = stats["blend_seconds"] / requests * 1e3
    total_ms = stats["blend_total_seconds"] / requests * 1e3
    rope_ms = stats["blend_rope_seconds"] / requests * 1e3
    cold_ms = statistics.median(times["cold"]) * 1e3
    blend_ms = statistics.median(times["blend"]) * 1e3
    record(
        metric="blend TTFT in vLLM vs cold prefill",
        value=blend_ms,
        unit="ms",
        baseline="cold prefill TTFT, same engine (same run)",
        baseline_value=cold_ms,
        num_tokens=length,
        claimed_tokens=claimed[0],
        reused_tokens=DOCS * DOC_TOKENS,
        recompute_ratio=RATIO,
        blend_compute_ms=round(compute_ms, 1),
        blend_total_ms=round(total_ms, 1),
        rope_ms=round(rope_ms, 1),
        cold_ms_all=[round(t * 1e3, 1) for t in times["cold"]],
        blend_ms_all=[round(t * 1e3, 1) for t in times["blend"]],
    )
    print(
        f"\n{length}-token prompt: blend TTFT {blend_ms:.0f} ms, cold {cold_ms:.0f} ms "
        f"(x{blend_ms / cold_ms:.3f}); vLLM cached {claimed[0]} tokens; kvtier's blend "
        f"computation {compute_ms:.0f} ms (RoPE {rope_ms:.0f} ms), all of it {total_ms:.0f} ms"
    )
