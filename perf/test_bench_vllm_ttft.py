"""Time to first token in a real vLLM engine (CPU build): a kvtier hit vs cold prefill,
and what kvtier costs on a pure miss workload vs vLLM with no connector.

Model: the demo's random-weight Llama (8 layers, 16 heads / 4 KV heads, head size 64,
bf16). TTFT is the wall time of a one-token greedy generation; each figure is the median
over distinct prompts. The warm case resets vLLM's own prefix cache first, so the hit can
only come from kvtier.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT_TOKENS = [1024, 2048, 4000]
REPEATS = 3


def _engine(model: Path, kvtier: bool):
    from kvtier.demo_vllm import make_engine

    extra = {"chunk_size": 256, "max_local_cpu_size": 4} if kvtier else None
    return make_engine(model, max_model_len=4200, kvtier=extra)


def _ttft(llm, prompt: list[int]) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1)
    start = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return time.perf_counter() - start


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 8192) for _ in range(n)] for _ in range(REPEATS)]


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("vllm")
    from kvtier.demo_vllm import build_model

    return build_model(Path(tempfile.gettempdir()) / "kvtier-demo-llama-v1")


@pytest.fixture(scope="module")
def timings(model):
    from kvtier.demo_vllm import shutdown_engine as shutdown

    results: dict[str, dict[int, float]] = {"none": {}, "cold": {}, "warm": {}}
    llm = _engine(model, kvtier=False)
    _ttft(llm, _prompts(64, 99)[0])  # warm-up
    for n in PROMPT_TOKENS:
        results["none"][n] = statistics.median(_ttft(llm, p) for p in _prompts(n, n))
    shutdown(llm)
    llm = _engine(model, kvtier=True)
    _ttft(llm, _prompts(64, 99)[0])
    for n in PROMPT_TOKENS:
        cold, warm = [], []
        for prompt in _prompts(n, n):
            cold.append(_ttft(llm, prompt))
            llm.reset_prefix_cache()
            warm.append(_ttft(llm, prompt))
        results["cold"][n] = statistics.median(cold)
        results["warm"][n] = statistics.median(warm)
    shutdown(llm)
    return results


@pytest.mark.parametrize("tokens", PROMPT_TOKENS)
def test_ttft_warm_vs_cold(timings, record, tokens):
    record(
        metric=f"ttft_warm_kvtier_{tokens}_tokens",
        value=timings["warm"][tokens],
        unit="s",
        baseline=f"ttft_cold_prefill_{tokens}_tokens",
        baseline_value=timings["cold"][tokens],
    )
    assert timings["warm"][tokens] > 0


@pytest.mark.parametrize("tokens", PROMPT_TOKENS)
def test_ttft_miss_overhead_vs_no_connector(timings, record, tokens):
    record(
        metric=f"ttft_miss_kvtier_{tokens}_tokens",
        value=timings["cold"][tokens],
        unit="s",
        baseline=f"ttft_no_connector_{tokens}_tokens",
        baseline_value=timings["none"][tokens],
    )
    assert timings["cold"][tokens] > 0
