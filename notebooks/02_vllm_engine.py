# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # kvtier inside a real vLLM engine
#
# vLLM keeps a prefix cache of its own in its paged KV memory, but that memory is small
# and busy: a prompt's KV is soon evicted. kvtier plugs into vLLM as a KV connector and
# keeps a copy of every prompt's KV, in chunks, in larger tiers behind it. When a request
# comes back whose prefix vLLM has forgotten, kvtier loads the KV into the request's blocks
# and vLLM computes only the rest of the prompt.
#
# This notebook starts **one** vLLM engine (vLLM's CPU build) on a tiny random-weight
# Llama built locally (nothing is downloaded), serves a prompt cold, makes vLLM forget it,
# and serves it again from kvtier: fewer tokens computed, a shorter time to first token,
# and the same greedy output as a full recomputation. It ends by reading kvtier's
# Prometheus metrics from the engine. It takes about 15 seconds on a 2-core CPU.

# %%
import os

# vLLM's CPU build starts its engine core in a *spawned* process, and a spawned process
# first re-runs the main script (here: this notebook, run as `python 02_vllm_engine.py`)
# unless the code sits under `if __name__ == "__main__":`, which notebook cells cannot.
# So the engine core runs in this process: the notebook then runs the same in Jupyter and
# as a script. (Set before vLLM is imported.) A server, `vllm.entrypoints.openai.api_server`,
# runs the same connector with its scheduler and worker in separate processes.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import random
import socket
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from kvtier.demo_vllm import build_llama, shutdown_engine, transfer_config

# %% [markdown]
# ## A tiny local model
#
# `build_llama` writes a `transformers` Llama with random weights (fixed seed) as
# safetensors plus `config.json`: 4 layers, 16 query heads sharing 4 KV heads of size 64.
# Its weights are drawn wide enough (N(0, 0.08)) that greedy decoding is far from ties, so
# "identical output" is a sharp test of the KV each token attends to. vLLM runs it in
# float32 and is given token ids (no tokenizer).

# %%
workdir = tempfile.TemporaryDirectory(prefix="kvtier-notebook-vllm-")
VOCAB = 4096
model = build_llama(
    Path(workdir.name) / "tiny-llama",
    num_layers=4,
    num_heads=16,
    num_kv_heads=4,
    head_size=64,
    intermediate_size=2816,
    vocab_size=VOCAB,
    weight_std=0.08,
)
print(sorted(path.name for path in model.iterdir()))

# %% [markdown]
# ## The engine, with kvtier as its KV connector
#
# kvtier's own settings go in `kv_connector_extra_config`: chunks of 256 tokens, a
# 0.5 GB memory tier, and a Prometheus endpoint (`metrics_port`). vLLM's CPU backend uses
# blocks of 32 tokens here; kvtier moves whole blocks on that backend.

# %%
with socket.socket() as probe:  # a free port for the metrics endpoint
    probe.bind(("127.0.0.1", 0))
    METRICS_PORT = probe.getsockname()[1]

CHUNK_SIZE, BLOCK_SIZE = 256, 32
kvtier_config = {"chunk_size": CHUNK_SIZE, "max_local_cpu_size": 0.5, "metrics_port": METRICS_PORT}
print("--kv-transfer-config", transfer_config(kvtier_config))

llm = LLM(
    model=str(model),
    skip_tokenizer_init=True,
    dtype="float32",
    block_size=BLOCK_SIZE,
    max_model_len=2048,
    kv_cache_memory_bytes=256 << 20,
    enforce_eager=True,
    seed=0,
    kv_transfer_config=transfer_config(kvtier_config),
)


def serve(prompt: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """Greedy generation of one prompt: (seconds, output token ids, prompt tokens that
    were not computed: vLLM's own prefix hit plus what kvtier loaded)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return time.perf_counter() - start, list(out.outputs[0].token_ids), out.num_cached_tokens


def scrape() -> dict[tuple[str, str], float]:
    """kvtier's metrics from the engine's endpoint: ``{(sample name, rank): value}``."""
    url = f"http://127.0.0.1:{METRICS_PORT}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, sample.labels["rank"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if "tier" not in sample.labels
    }


rng = random.Random(0)
PROMPT_TOKENS = 1040
prompt = [rng.randrange(1, VOCAB) for _ in range(PROMPT_TOKENS)]
warmup = [rng.randrange(1, VOCAB) for _ in range(100)]  # shorter than a chunk: not stored

serve(warmup, 2)  # the first steps of a new engine are slower: keep them out of the timing
metrics_before = scrape()

# %% [markdown]
# ## Cold, then a kvtier hit
#
# Time to first token (TTFT) is the wall time of a one-token generation. The first time,
# vLLM prefills all 1040 tokens, and kvtier stores the 4 full chunks (1024 tokens) as they
# are computed. Then `reset_prefix_cache()` empties vLLM's own prefix cache (and leaves
# kvtier alone), so the second time the KV can only come from kvtier.
#
# On vLLM's CPU backend kvtier loads whole blocks, and vLLM must compute at least the
# last token to sample the next one: it loads ⌊(1040 − 1) / 32⌋ × 32 = 1024 tokens here
# and vLLM computes 16.

# %%
cold_ttft, cold_first, cold_cached = serve(prompt, 1)
print(f"cold:  TTFT {cold_ttft:.3f} s, {cold_cached} prompt tokens not computed")

llm.reset_prefix_cache()  # vLLM forgets; kvtier keeps
hit_ttft, hit_first, loaded = serve(prompt, 1)
print(
    f"kvtier hit: TTFT {hit_ttft:.3f} s, {loaded} tokens loaded from kvtier, "
    f"{PROMPT_TOKENS - loaded} computed"
)
print(f"TTFT saved: {cold_ttft - hit_ttft:.3f} s ({cold_ttft / hit_ttft:.1f}x faster)")

# %% [markdown]
# ## Same output as a full recomputation
#
# 16 greedy tokens served from kvtier, against 16 greedy tokens after emptying kvtier
# too (`reset_prefix_cache(reset_connector=True)`), so the whole prompt is computed again.

# %%
llm.reset_prefix_cache()
_, from_kvtier, from_kvtier_cached = serve(prompt, 16)
metrics_after = scrape()

llm.reset_prefix_cache(reset_connector=True)  # empty kvtier too: a full recomputation
_, recomputed, recomputed_cached = serve(prompt, 16)
print("served from kvtier:", from_kvtier)
print("recomputed:        ", recomputed)
print("identical" if from_kvtier == recomputed else "MISMATCH")

# %% [markdown]
# ## What the metrics say
#
# The engine's `/metrics` endpoint serves every worker rank's numbers (`rank="0"` here)
# and the scheduler's lookup counters (`rank="scheduler"`). Between the two scrapes the
# prompt was stored once (4 chunks) and loaded twice; each load read the 4 chunks:
# 1024 tokens of K and V for 4 layers x 4 KV heads x 64 floats.


# %%
def delta(name: str, rank: str = "0") -> float:
    return metrics_after.get((name, rank), 0.0) - metrics_before.get((name, rank), 0.0)


CHUNK_BYTES = 2 * 4 * CHUNK_SIZE * 4 * 64 * 4  # K and V x layers x tokens x heads x dim x fp32
for name, rank in (
    ("kvtier_stored_chunks_total", "0"),
    ("kvtier_stored_tokens_total", "0"),
    ("kvtier_stored_bytes_total", "0"),
    ("kvtier_retrieve_requests_total", "0"),
    ("kvtier_retrieve_hit_tokens_total", "0"),
    ("kvtier_loaded_bytes_total", "0"),
    ("kvtier_lookup_tokens_total", "scheduler"),
    ("kvtier_lookup_hit_tokens_total", "scheduler"),
):
    print(f"{name:36s} rank={rank:9s} +{delta(name, rank):,.0f}")
seconds = delta("kvtier_load_seconds_total")
print(f"load bandwidth (measured): {delta('kvtier_loaded_bytes_total') / seconds / 1e9:.2f} GB/s")

shutdown_engine(llm)
workdir.cleanup()

# %% [markdown]
# ## Results

# %%
assert cold_cached == 0  # cold: everything computed
assert loaded == from_kvtier_cached == 1024  # hit: 1024 of 1040 tokens from kvtier
assert hit_ttft < cold_ttft, f"a kvtier hit ({hit_ttft:.3f} s) should beat cold ({cold_ttft:.3f} s)"
assert recomputed_cached == 0  # kvtier emptied: computed again
assert cold_first == hit_first == from_kvtier[:1]  # the first token, three ways
assert from_kvtier == recomputed  # 16 greedy tokens, identical

assert delta("kvtier_stored_chunks_total") == 4
assert delta("kvtier_stored_tokens_total") == 1024
assert delta("kvtier_stored_bytes_total") == 4 * CHUNK_BYTES
assert delta("kvtier_retrieve_requests_total") == 2
assert delta("kvtier_retrieve_hit_tokens_total") == 2 * 1024
assert delta("kvtier_loaded_bytes_total") == 2 * 4 * CHUNK_BYTES
assert delta("kvtier_corrupt_chunks_rejected_total") == 0
assert delta("kvtier_lookup_tokens_total", "scheduler") == 3 * PROMPT_TOKENS  # 3 requests
assert delta("kvtier_lookup_hit_tokens_total", "scheduler") == 2 * 1024  # 2 of them hit
print("all results as expected")
