"""Shared helpers for the real-engine tests (marked ``vllm``).

Engines are expensive (~25 s to start on a 2-core CPU), so each test module starts few
and shares them through module-scoped fixtures. Prompts are token ids (no tokenizer);
decoding is greedy. The tiny models are float32 so that "identical outputs" compares the
KV a request attends to, not bf16 rounding differences between prefill batch shapes.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.demo_vllm import make_engine, transfer_config
from kvtier.demo_vllm import shutdown_engine as shutdown  # noqa: F401 - for the test modules


@dataclass(frozen=True)
class Result:
    """One request's greedy output and how many prompt tokens it did not compute."""

    token_ids: tuple[int, ...]
    num_cached_tokens: int
    finish_reason: str | None = None  # "length" here; "error" for a failed request


def prompts_of(lengths: list[int], *, seed: int = 0, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def kv_transfer_config(
    extra: dict[str, Any], *, engine_id: str | None = None, kv_role: str = "kv_both"
) -> dict:
    """kvtier's ``kv_transfer_config`` with a fresh engine id unless one is given."""
    engine_id = engine_id or f"kvtier-test-{uuid.uuid4().hex[:8]}"
    return transfer_config(extra, engine_id=engine_id, kv_role=kv_role)


def make_llm(
    model: Path,
    *,
    block_size: int = 32,
    kvtier: dict[str, Any] | None = None,
    engine_id: str | None = None,
    dtype: str = "float32",
    max_model_len: int = 2048,
    **kwargs: Any,
):
    """A ``vllm.LLM`` on the CPU for the tests (float32, a small KV cache, a fresh engine
    id); ``kvtier`` is the connector's extra config (None: no connector)."""
    return make_engine(
        model,
        max_model_len=max_model_len,
        kvtier=kvtier,
        engine_id=engine_id or f"kvtier-test-{uuid.uuid4().hex[:8]}",
        dtype=dtype,
        block_size=block_size,
        kv_cache_memory_bytes=128 << 20,
        seed=0,
        **kwargs,
    )


def generate(llm, prompts: list[list[int]], max_tokens: int = 8) -> list[Result]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    return [
        Result(
            tuple(o.outputs[0].token_ids),
            int(o.num_cached_tokens or 0),
            o.outputs[0].finish_reason,
        )
        for o in outputs
    ]


def generate_resetting(
    llm, prompts: list[list[int]], *, after_steps: int, max_tokens: int = 8
) -> list[Result]:
    """``generate``, but after ``after_steps`` engine steps vLLM's prefix cache is reset with
    ``reset_running_requests``: the running requests are preempted and resumed."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"resetting-{uuid.uuid4().hex[:8]}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        steps += 1
        if steps == after_steps:
            assert llm.reset_prefix_cache(reset_running_requests=True)
    return [
        Result(
            tuple(finished[i].outputs[0].token_ids),
            int(finished[i].num_cached_tokens or 0),
            finished[i].outputs[0].finish_reason,
        )
        for i in ids
    ]


def expected_loaded(
    num_tokens: int, *, chunk_size: int, block_size: int, partial: bool = False
) -> int:
    """Tokens kvtier loads for a fully stored prompt on vLLM's CPU backend: whole chunks
    (with ``partial``: the prompt's partial last chunk too, up to its last whole block),
    never the last token, cut to whole blocks (the CPU backend's KV layout)."""
    unit = block_size if partial else chunk_size
    stored = num_tokens // unit * unit
    return min(stored, num_tokens - 1) // block_size * block_size


def worker_stats(engine_id: str, rank: int = 0) -> dict[str, float]:
    """Counters of a running engine's kvtier worker, over its lookup socket."""
    from kvtier.integration.vllm.rpc import RpcClient, endpoint_for

    with RpcClient([endpoint_for(f"{engine_id}-dp0", rank)], timeout=5.0) as client:
        replies = client.call_all("stats")
    assert replies is not None, "the kvtier worker did not answer the stats request"
    return replies[0]


def worker_stats_once_written(
    engine_id: str, counter: str, expected: int, timeout: float = 120.0
) -> dict[str, float]:
    """``worker_stats`` once ``counter`` (a lower tier's ``<tier>_put_chunks``) reached
    ``expected``, or after ``timeout`` seconds: the lower tiers' writer threads encode,
    checksum and write off the request path, so a step can end before its chunks are
    written."""
    deadline = time.monotonic() + timeout
    stats = worker_stats(engine_id)
    while stats.get(counter, 0) < expected and time.monotonic() < deadline:
        time.sleep(0.1)
        stats = worker_stats(engine_id)
    return stats


def run_support_script(name: str, config: dict[str, Any], out: Path) -> dict[str, Any]:
    """Run ``tests/support/<name>`` in its own process (an engine of its own) with ``config``
    as JSON; the result it writes to ``out``."""
    script = Path(__file__).resolve().parent / name
    proc = subprocess.run(
        [sys.executable, str(script), json.dumps(config), str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())
