"""One engine configuration of the TTFT benchmark, in a fresh process.

``perf/benchmarks/test_bench_vllm_ttft.py`` starts this script once per configuration and round,
alternating ``--mode none`` (vLLM with no connector) and ``--mode kvtier`` (vLLM with
``KVTierConnector``), so that neither configuration inherits the other's warm-up,
allocator state or threads. One run:

1. starts the engine (the demo's random-weight Llama, ``kvtier.demo_vllm.make_engine``);
2. warms up, not timed: per length of ``--tokens``, one throw-away prompt; with kvtier it
   is served again after vLLM's prefix cache is reset, so the load path has run too
   (``--extra-tokens`` are not warmed up on their own: same kernels, one step each);
3. misses, timed: ``--prompts`` new random prompts per length of ``--tokens`` (lengths
   interleaved), then ``--extra-prompts`` per length of ``--extra-tokens``; never seen by
   this engine, so neither vLLM's prefix cache nor kvtier can serve any token (vLLM's
   ``num_cached_tokens`` is recorded: 0 for every miss); with kvtier this is the whole
   cost of a miss, lookup and store included;
4. hits, timed (``--mode kvtier`` only): vLLM's prefix cache is reset and the same prompts
   are served again, so their KV can only come from kvtier.

The benchmark compares the two modes on ``--tokens`` only: both modes then serve exactly
the same sequence of requests up to the end of those misses. ``--extra-tokens`` (kvtier
runs) adds lengths measured only for cold vs hit.

TTFT is the wall time of a one-token greedy generation. Every timing is written to
``--json`` (seconds, per length, in serving order) with the tokens vLLM reported cached
and the CPUs the engine's processes' threads are bound to.

NOTE: vLLM's CPU build binds the worker's OpenMP threads to all cores but the ones it
reserves for the scheduler: one per worker, plus one more per worker whenever a
``kv_transfer_config`` is set (meant for NIXL). On a 2-core machine that reservation
cannot be met with a connector, so vLLM reserves nothing: the kvtier engine would compute
on 2 threads and the no-connector engine on 1, a 2x difference that is not kvtier's. Every
run therefore sets ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (vLLM's own choice without a
connector) unless the environment already sets it, and records the binding it got.

    python perf/benchmarks/vllm_ttft_run.py --mode kvtier --tokens 1024 2048 --prompts 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

MAX_MODEL_LEN = 4200
# The connector's config: 256-token chunks in a 2 GB CPU tier, far more than the
# benchmark's prompts (8 KiB of KV per token with the demo's model).
KVTIER_CONFIG = {"chunk_size": 256, "max_local_cpu_size": 2}
VOCAB_SIZE = 8192
RESERVED_CPUS = "1"


def default_model_path() -> Path:
    """Where the demo (and the benchmark) keep the random-weight Llama."""
    return Path(tempfile.gettempdir()) / "kvtier-demo-llama-v1"


def thread_cpus() -> dict[str, dict[str, int]]:
    """For each process below this one: the CPU sets its threads may run on, each with how
    many threads have it (``{"VLLM::Worker": {"0": 46}}``: 46 threads all on CPU 0)."""
    import psutil

    cpus: dict[str, dict[str, int]] = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            name, threads = proc.name(), proc.threads()
        except psutil.Error:
            continue
        counts = cpus.setdefault(name, {})
        for thread in threads:
            try:
                key = ",".join(map(str, sorted(os.sched_getaffinity(thread.id))))
            except OSError:  # the thread exited
                continue
            counts[key] = counts.get(key, 0) + 1
    return cpus


def random_prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(1, VOCAB_SIZE) for _ in range(tokens)]


def run(
    *,
    mode: str,
    tokens: list[int],
    prompts: int,
    extra_tokens: list[int],
    extra_prompts: int,
    seed: int,
    model: Path,
    warmup_seed: int | None = None,
    kvtier_extra: dict[str, object] | None = None,
    kv_role: str = "kv_both",
) -> dict[str, object]:
    """Start one engine, warm it up, time misses (and hits with kvtier); the timings in
    seconds and the tokens vLLM reported cached, per length in serving order."""
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.demo_vllm import build_model, make_engine, shutdown_engine

    build_model(model)
    kvtier_config = {**KVTIER_CONFIG, **(kvtier_extra or {})} if mode == "kvtier" else None
    start = time.perf_counter()
    llm = make_engine(model, max_model_len=MAX_MODEL_LEN, kvtier=kvtier_config, kv_role=kv_role)
    startup_s = time.perf_counter() - start
    cpus = thread_cpus()
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def serve(prompt: list[int]) -> tuple[float, int]:
        t0 = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        return time.perf_counter() - t0, out.num_cached_tokens or 0

    # NOTE: the warm-up prompts come from their own generator, so they never share a
    # prefix with a timed prompt (random tokens: a shared first block is out of reach).
    lengths = [*tokens, *extra_tokens]
    warmup_rng = random.Random(f"warmup-{seed if warmup_seed is None else warmup_seed}")
    for n in tokens:
        prompt = random_prompt(warmup_rng, n)
        serve(prompt)
        if mode == "kvtier":
            llm.reset_prefix_cache()
            serve(prompt)

    # Serving order: rounds of one prompt per length, so a slow spell of the machine
    # spreads over every length instead of landing on one.
    rng = random.Random(f"timed-{seed}")
    order = [n for _ in range(prompts) for n in tokens]
    order += [n for _ in range(extra_prompts) for n in extra_tokens]
    timed = [(n, random_prompt(rng, n)) for n in order]
    miss: dict[int, list[float]] = {n: [] for n in lengths}
    miss_cached: dict[int, list[int]] = {n: [] for n in lengths}
    for n, prompt in timed:
        seconds, cached = serve(prompt)
        miss[n].append(seconds)
        miss_cached[n].append(cached)

    hit: dict[int, list[float]] = {n: [] for n in lengths}
    hit_cached: dict[int, list[int]] = {n: [] for n in lengths}
    if mode == "kvtier":
        llm.reset_prefix_cache()  # vLLM forgets every timed prompt; kvtier keeps them
        for n, prompt in timed:
            seconds, cached = serve(prompt)
            hit[n].append(seconds)
            hit_cached[n].append(cached)

    shutdown_engine(llm)
    return {
        "mode": mode,
        "seed": seed,
        "warmup_seed": seed if warmup_seed is None else warmup_seed,
        "pid": os.getpid(),
        "vllm": vllm.__version__,
        "kvtier_config": kvtier_config,
        "kv_role": kv_role if mode == "kvtier" else None,
        "startup_s": startup_s,
        "reserved_cpus": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"),
        "thread_cpus": cpus,
        "tokens": tokens,
        "extra_tokens": extra_tokens,
        "miss_s": miss,
        "miss_cached_tokens": miss_cached,
        "hit_s": hit,
        "hit_cached_tokens": hit_cached,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("none", "kvtier"), required=True)
    parser.add_argument("--tokens", type=int, nargs="+", required=True)
    parser.add_argument("--prompts", type=int, default=3, help="timed prompts per length")
    parser.add_argument("--extra-tokens", type=int, nargs="*", default=[])
    parser.add_argument("--extra-prompts", type=int, default=1, help="per extra length")
    parser.add_argument("--seed", type=int, default=0, help="selects the random prompts")
    parser.add_argument(
        "--warmup-seed",
        type=int,
        default=None,
        help="selects the warm-up prompts (default: --seed): an engine that serves another "
        "engine's prompts warms up on prompts of its own",
    )
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--json", type=Path, required=True, help="where the timings go")
    parser.add_argument(
        "--kvtier-extra",
        type=json.loads,
        default={},
        help="JSON of config keys over the default kvtier config (e.g. a remote_url)",
    )
    parser.add_argument(
        "--kv-role",
        choices=("kv_both", "kv_producer", "kv_consumer"),
        default="kv_both",
        help="vLLM's kv_role of the kvtier engine (disaggregated prefill)",
    )
    args = parser.parse_args(argv)
    if max(args.tokens + args.extra_tokens) + 1 > MAX_MODEL_LEN:
        parser.error(f"--tokens: at most {MAX_MODEL_LEN - 1} (the engine's max_model_len)")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", RESERVED_CPUS)
    result = run(
        mode=args.mode,
        tokens=args.tokens,
        prompts=args.prompts,
        extra_tokens=args.extra_tokens,
        extra_prompts=args.extra_prompts,
        seed=args.seed,
        model=args.model,
        warmup_seed=args.warmup_seed,
        kvtier_extra=args.kvtier_extra,
        kv_role=args.kv_role,
    )
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
