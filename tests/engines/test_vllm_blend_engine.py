"""CacheBlend inside a real vLLM engine (CPU build) through kvtier's connector.

One prompt stores its documents as segments; a second prompt puts them in another order
behind a different system prompt and a new question. vLLM has none of the second prompt
in its own prefix cache, so everything it reuses comes from the blend: kvtier claims all
but its last token and writes their blended KV into vLLM's blocks.

* ratio 1.0: every token is recomputed with the running model's own layers; the greedy
  output equals an engine's with no connector, and ``num_cached_tokens`` is the claim.
* ratio 0.15 (the engine's configured ratio): an approximation; it must equal the same
  blend run by ``kvtier.blend`` over transformers' model, and its token agreement with
  the engine without a connector over 32 tokens is reported.
* the quality curve: the same prompt blended again at ratios 0, 0.05, 0.3 and 1.0 (the
  worker probes of ``support.blend_probe`` change the ratio and read the KV back from
  vLLM's blocks), its KV deviation from a full prefill per layer, against plain reuse.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

import pytest
from support import blend_probe
from support.blend import blended_greedy
from support.engines import Result, generate, make_llm, shutdown, worker_stats
from support.models import add_word_tokenizer, make_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

SEP_TEXT = " w7 w7 "  # the word tokenizer: token 7 twice
SEP = [7, 7]
BLOCK = 32
MAX_TOKENS = 32


def _words(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(8, 500) for _ in range(n)]


def _prompts() -> tuple[list[int], list[int]]:
    rng = random.Random(18)
    sys_a, sys_b = _words(40, rng), _words(44, rng)
    doc_a, doc_b, doc_c = (_words(n, rng) for n in (96, 80, 110))
    q1, q2 = _words(20, rng), _words(17, rng)
    first = [*sys_a, *SEP, *doc_a, *SEP, *doc_b, *SEP, *doc_c, *SEP, *q1]
    second = [*sys_b, *SEP, *doc_c, *SEP, *doc_a, *SEP, *doc_b, *SEP, *q2]
    return first, second


@pytest.fixture(scope="module")
def blend_model(tmp_path_factory):
    pytest.importorskip("vllm")
    return add_word_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("models") / "llama-b"))


@pytest.fixture(scope="module")
def reference(blend_model):
    """Each prompt alone, greedy, in an engine with no connector."""
    llm = make_llm(blend_model, block_size=BLOCK)
    try:
        return [generate(llm, [p], MAX_TOKENS)[0] for p in _prompts()]
    finally:
        shutdown(llm)


RATIOS = (0.0, 0.05, 0.15, 0.3, 1.0)


@dataclass(frozen=True)
class BlendRuns:
    first: Result  # the first prompt: stored its segments
    blended: dict[float, Result]  # ratio -> the second prompt, blended
    curve: dict[str, list[float]]  # ratio (or "plain") -> per-layer KV deviation
    stats: dict


@pytest.fixture(scope="module")
def runs(blend_model) -> BlendRuns:
    """One engine configured at ratio 0.15 blends the second prompt; then, through the
    worker probes, the same prompt again at every other ratio (vLLM's prefix cache reset
    in between, so the blend runs each time) with its KV read back from vLLM's blocks."""
    engine_id = "kvtier-test-blend"
    extra = {
        "chunk_size": 64,
        "enable_blending": True,
        "blend_special_str": SEP_TEXT,
        "blend_recompute_ratios": [0.15],
        "blend_min_tokens": 32,
    }
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the probes are functions
        llm = make_llm(blend_model, block_size=BLOCK, kvtier=extra, engine_id=engine_id)
        try:
            llm.collective_rpc(blend_probe.record_blends)
            first, second = _prompts()
            stored = generate(llm, [first], MAX_TOKENS)[0]
            blended = {}
            for ratio in (0.15, *(r for r in RATIOS if r != 0.15)):
                llm.collective_rpc(blend_probe.set_ratio, args=(ratio,))
                assert llm.reset_prefix_cache()
                blended[ratio] = generate(llm, [second], MAX_TOKENS)[0]
                llm.collective_rpc(blend_probe.keep_blended_kv, args=(ratio,))
            (curve,) = llm.collective_rpc(blend_probe.deviations)
            return BlendRuns(stored, blended, curve, worker_stats(engine_id))
        finally:
            shutdown(llm)


def test_ratio_one_equals_no_connector(runs, reference) -> None:
    prompt = _prompts()[1]
    assert runs.first.token_ids == reference[0].token_ids  # stored the segments, not blended
    assert runs.first.num_cached_tokens == 0
    assert runs.stats["blend_stored_segments"] == 4  # sys A and three documents
    assert runs.stats["blend_requests"] == len(RATIOS)
    assert runs.stats["blend_reused_tokens"] == len(RATIOS) * (96 + 80 + 110)
    one = runs.blended[1.0]
    assert one.num_cached_tokens == len(prompt) - 1  # everything but the last token
    assert one.token_ids == reference[1].token_ids
    _check_placement_exact(runs.stats)


def _check_placement_exact(stats: dict) -> None:
    """Layer 0's KV depends on a token and its position only: the cached segments, read
    back from vLLM's blocks and re-rotated to their new positions, must match the KV the
    blend computes there up to float32 rounding."""
    relative = stats["blend_check_deviation"] / stats["blend_check_norm"]
    print(f"layer-0 deviation of the placed segments: {relative:.2e} (relative squared)")
    assert relative < 1e-10


def test_ratio_015_runs_and_agrees(blend_model, runs, reference) -> None:
    prompt = _prompts()[1]
    second = runs.blended[0.15]  # the first blend, at the configured ratio
    assert second.num_cached_tokens == len(prompt) - 1
    assert len(second.token_ids) == MAX_TOKENS
    # recomputed: every fresh token, plus 15 % of the reused ones (ceil), in each blend
    fresh = len(prompt) - 1 - (96 + 80 + 110)
    reused = 96 + 80 + 110
    recomputed = sum(fresh + min(math.ceil(r * reused), reused) for r in RATIOS)
    assert runs.stats["blend_recomputed_tokens"] == recomputed
    same, lead = _agreement(second, reference[1])
    print(f"ratio 0.15: {same}/{MAX_TOKENS} tokens agree, first {lead} identical")
    # The same blend by kvtier.blend over transformers' model of the same checkpoint:
    # the engine's approximation is the algorithm's, not an artefact of the integration.
    expected = blended_greedy(
        blend_model, *_prompts(), SEP, 0.15, min_tokens=32, max_tokens=MAX_TOKENS
    )
    assert list(second.token_ids) == expected


def _agreement(result: Result, reference: Result) -> tuple[int, int]:
    """Tokens equal to the reference's, and how many lead before the first difference."""
    pairs = list(zip(result.token_ids, reference.token_ids, strict=True))
    lead = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
    return sum(a == b for a, b in pairs), lead


def test_quality_curve_in_the_engine(runs, reference) -> None:
    """The KV each ratio wrote into vLLM's blocks, against a full prefill of the prompt
    through the running model: the deviation falls as the ratio rises, stays below plain
    reuse (no re-rotation, no recompute) at every ratio below 1, and vanishes at 1."""
    mean = {key: sum(layers) / len(layers) for key, layers in runs.curve.items()}
    curve = [mean[str(r)] for r in RATIOS]
    for r in RATIOS:
        same, lead = _agreement(runs.blended[r], reference[1])
        layers = ", ".join(f"{d:.3f}" for d in runs.curve[str(r)])
        print(
            f"ratio {r}: deviation {mean[str(r)]:.4f} (layers {layers}); "
            f"{same}/{MAX_TOKENS} tokens agree, first {lead} identical"
        )
    print(f"plain reuse: deviation {mean['plain']:.4f}")
    assert all(a > b for a, b in itertools.pairwise(curve)), curve
    assert all(c < mean["plain"] for c in curve[:-1]), (curve, mean["plain"])
    assert curve[-1] < 1e-10
