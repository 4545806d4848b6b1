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
# # Compression: ratio vs error for the CacheGen codec on real KV
#
# A chunk of KV is big: K and V, every layer, every token, every channel, in bf16. When
# it has to cross a network (a remote tier) or sit on a disk, fewer bytes can matter more
# than a little precision. kvtier's `cachegen` codec (`kvtier_kernels/cachegen/codec.py`, after
# CacheGen, SIGCOMM 2024) quantizes each token's row of each layer to `2n + 1` levels
# (`n`, "levels_half", is chosen per layer) and entropy-codes the symbols with rANS.
# Its error is bounded: every element is within `scale / (2n)` of the original, where
# `scale` is the absmax of the element's (K/V, layer, token) row.
#
# This notebook takes the KV of a real forward pass of a small random-weight Llama
# (`transformers`, built locally, nothing downloaded), compresses it with several level
# schedules, and plots compression ratio against error next to a plain 8-bit baseline.
# Then it uses the codec as a tier serde (`remote_serde: cachegen`): the chunks kvtier
# writes to a local disk directory are several times smaller, and what it loads back is
# within the bound. Every number it prints is asserted at the end.

# %%
import json
import tempfile
import time
from itertools import pairwise
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: the plot goes to a file
import matplotlib.pyplot as plt
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvtier.config import load_config
from kvtier.engine import CacheEngine, EngineMetadata
from kvtier_kernels import PagedKV, registry
from kvtier_kernels.cachegen import decode_chunk, default_levels, encode_chunk

# %% [markdown]
# ## KV from a real forward pass
#
# A Llama with 8 layers and 8 query heads sharing 4 KV heads of size 128 (grouped-query
# attention), random weights with `transformers`' default init, runs one forward pass over
# 512 random token ids. Its cache holds what a serving engine would cache: K after RoPE,
# and V. We lay it out as kvtier's chunks do, `KV_2LTD` = `[2, layers, tokens, kv_heads *
# head_size]`, in bf16.

# %%
LAYERS, HEADS, KV_HEADS, HEAD_SIZE = 8, 8, 4, 128
TOKENS, CHUNK_SIZE, VOCAB = 512, 256, 1024
DTYPE = torch.bfloat16

llama_config = LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=HEADS * HEAD_SIZE,
    intermediate_size=2 * HEADS * HEAD_SIZE,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_SIZE,
    max_position_embeddings=TOKENS,
)
torch.manual_seed(0)
model = LlamaForCausalLM(llama_config).eval()
prompt = torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    cache = model(prompt[None], use_cache=True, past_key_values=DynamicCache()).past_key_values


def layer_kv(layer: int, which: str) -> torch.Tensor:
    """One layer's K or V as ``[tokens, kv_heads * head_size]``."""
    t = getattr(cache.layers[layer], which)  # [1, kv_heads, tokens, head_size]
    return t[0].transpose(0, 1).reshape(TOKENS, KV_HEADS * HEAD_SIZE)


kv = torch.stack(
    [
        torch.stack([layer_kv(layer, which) for layer in range(LAYERS)])
        for which in ("keys", "values")
    ]
).to(DTYPE)
RAW_BYTES = kv.numel() * kv.element_size()
print(f"KV of the prompt: {list(kv.shape)} {kv.dtype}, {RAW_BYTES:,} bytes")
print(f"K absmax per layer: {[round(v, 1) for v in kv[0].abs().amax(dim=(1, 2)).tolist()]}")
print(f"V absmax per layer: {[round(v, 2) for v in kv[1].abs().amax(dim=(1, 2)).tolist()]}")

# %% [markdown]
# ## How error is measured, and the 8-bit baseline
#
# One number per setting: the **largest error of any element relative to its row's
# absmax**, `max |x - x̂| / scale`. The codec bounds it by `1 / (2n) + 2**-20 + 2**-8`
# (`2**-20`: its own fp32 arithmetic; `2**-8`: rounding the reconstruction back to bf16),
# so a schedule's bound is set by its smallest `n`. We also print the relative Frobenius error `‖x - x̂‖ / ‖x‖`, which tells
# how much of the signal is lost overall.
#
# The baseline is the plain 8-bit code: per token, int8 codes of `x / (absmax / 127)` plus
# one fp32 scale per (K/V, layer, token) row — about 2× smaller than bf16, no entropy
# coding. The compressed size of a `cachegen` chunk is its payload plus its parameters
# (a few hundred bytes of JSON here; kvtier puts them in the object's header).

# %%
SLACK = 2.0**-20 + 2.0**-8  # the codec's fp32 arithmetic, then rounding to bf16


def errors(x: torch.Tensor, x_hat: torch.Tensor) -> tuple[float, float]:
    """(max |x - x̂| / row absmax, ‖x - x̂‖ / ‖x‖)."""
    xf, diff = x.float(), (x.float() - x_hat.float()).abs()
    scale = xf.abs().amax(dim=-1, keepdim=True)
    per_row = torch.where(scale > 0, diff / scale, diff)
    return per_row.max().item(), (diff.norm() / xf.norm()).item()


def int8_round_trip(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(x̂ in x's dtype, compressed bytes) of per-token absmax int8 + fp32 scales."""
    scale = x.float().abs().amax(dim=-1, keepdim=True) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(x.float() / safe).to(torch.int8)
    return (codes.float() * scale).to(x.dtype), codes.numel() + 4 * scale.numel()


def cachegen_round_trip(x: torch.Tensor, k_levels, v_levels) -> tuple[torch.Tensor, int]:
    """(x̂ in x's dtype, compressed bytes) of the cachegen codec, chunk by chunk."""
    x_hat, nbytes = torch.empty_like(x), 0
    for start in range(0, x.shape[2], CHUNK_SIZE):
        chunk = x[:, :, start : start + CHUNK_SIZE].contiguous()
        payload, params = encode_chunk(chunk, k_levels, v_levels)
        out = torch.empty_like(chunk)
        decode_chunk(payload, params, out)
        x_hat[:, :, start : start + CHUNK_SIZE] = out
        nbytes += len(payload) + len(json.dumps(params))
    return x_hat, nbytes


# %% [markdown]
# ## A sweep of level schedules
#
# Uniform schedules give every layer the same `n`: 32, 16, 8, 4 (65, 33, 17, 9 levels).
# The **default** schedule (`default_levels`) keeps 16 for the early layers, whose errors
# propagate through every later layer (keys: the first third; values: the first sixth),
# and 8 after.

# %%
default_k, default_v = default_levels(LAYERS)
print("default schedule: k_levels", default_k, "v_levels", default_v)
SCHEDULES = {f"uniform n={n}": ([n] * LAYERS, [n] * LAYERS) for n in (32, 16, 8, 4)}
SCHEDULES["default"] = (default_k, default_v)

results = {}
started = time.perf_counter()
for name, (k_levels, v_levels) in SCHEDULES.items():
    x_hat, nbytes = cachegen_round_trip(kv, k_levels, v_levels)
    max_err, fro = errors(kv, x_hat)
    bound = 1 / (2 * min(k_levels + v_levels)) + SLACK
    results[name] = {"ratio": RAW_BYTES / nbytes, "error": max_err, "fro": fro, "bound": bound}
    if name == "default":
        default_x_hat = x_hat  # compared with what the disk tier gives back, below
x_hat, nbytes = int8_round_trip(kv)
max_err, fro = errors(kv, x_hat)
int8 = {"ratio": RAW_BYTES / nbytes, "error": max_err, "fro": fro, "bound": 1 / 254 + SLACK}
results["int8 baseline"] = int8
sweep_seconds = time.perf_counter() - started

print(f"{'setting':16s} {'ratio':>7s} {'max err/scale':>14s} {'bound':>8s} {'rel. Frobenius':>15s}")
for name, r in results.items():
    print(f"{name:16s} {r['ratio']:6.2f}x {r['error']:14.4f} {r['bound']:8.4f} {r['fro']:15.4f}")
coder = registry.pick("rans_encode", "auto", "cpu")  # numba where installed, else numpy
print(f"(CPU codec, {coder} coder: {len(SCHEDULES)} schedules x {RAW_BYTES / 1e6:.1f} MB "
      f"encoded and decoded in {sweep_seconds:.1f} s)")  # fmt: skip

# %% [markdown]
# ## The plot
#
# Compression ratio (higher is smaller) against error (left: the bounded max error; right:
# relative Frobenius). Fewer levels move a point up and to the right; the default schedule
# sits between uniform 16 and uniform 8 in size, with uniform 8's worst case (its late
# layers use n = 8). The plot is written under the system's temp directory.

# %%
PLOT = Path(tempfile.gettempdir()) / "kvtier-notebooks" / "04_compression_ratio_vs_error.png"
PLOT.parent.mkdir(parents=True, exist_ok=True)
fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
for ax, key, label in (
    (axes[0], "error", "max |x - x̂| / row absmax"),
    (axes[1], "fro", "‖x - x̂‖ / ‖x‖"),
):
    for name, r in results.items():
        style = {"marker": "s", "color": "#aaaaaa"} if name == "int8 baseline" else {
            "marker": "o", "color": "#d62728" if name == "default" else "#1f77b4"
        }  # fmt: skip
        ax.scatter(r[key], r["ratio"], **style)
        ax.annotate(f" {name}", (r[key], r["ratio"]), fontsize=8, va="center")
    ax.set_xscale("log")
    ax.set_xlabel(label)
    ax.set_ylabel("compression ratio vs bf16")
    ax.axhline(1.0, color="#aaaaaa", linestyle="--", linewidth=0.8)
    ax.margins(x=0.25, y=0.1)
    ax.grid(alpha=0.3, which="both")
fig.suptitle(f"cachegen on Llama KV ({LAYERS} layers, {KV_HEADS}x{HEAD_SIZE}, {TOKENS} tokens)")
fig.tight_layout()
fig.savefig(PLOT, dpi=100)
plt.close(fig)
print(f"plot: {PLOT} ({PLOT.stat().st_size:,} bytes)")

# %% [markdown]
# ## The codec as a tier serde
#
# `remote_serde` picks the codec of the chunks kvtier writes to its disk and remote tiers
# (the memory tier always keeps the raw bytes). Two `CacheEngine`s store the same prompt
# from a paged cache in vLLM's CPU layout into their own local disk directory, one with
# `naive` (the bytes as they are) and one with `cachegen` (its default schedule). Then a
# restarted `cachegen` engine — empty memory, same directory — loads the prompt from disk
# into fresh pages.

# %%
BLOCK_SIZE = 16
NUM_BLOCKS = TOKENS // BLOCK_SIZE


def paged_cache(chunk: torch.Tensor | None) -> PagedKV:
    """A vLLM-CPU-layout cache holding ``chunk`` ([2, L, T, D]) in blocks 0, 1, ... (zeros
    when ``chunk`` is None)."""
    paged = PagedKV.empty(
        "vllm_cpu",
        num_layers=LAYERS,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        num_heads=KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=DTYPE,
    )
    for layer in range(LAYERS):
        view = paged.layer_view(layer)  # [2, blocks, block_size, kv_heads, head_size]
        if chunk is None:
            view.zero_()
        else:
            view.copy_(chunk[:, layer].reshape(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE))
    return paged


def paged_kv(paged: PagedKV) -> torch.Tensor:
    """The cache's tokens back as ``[2, L, T, D]``."""
    return torch.stack(
        [
            paged.layer_view(layer).reshape(2, TOKENS, KV_HEADS * HEAD_SIZE)
            for layer in range(LAYERS)
        ],
        dim=1,
    )


slots = torch.arange(TOKENS, dtype=torch.int64)
workdir = tempfile.TemporaryDirectory(prefix="kvtier-compression-")
disk_bytes = {}
for serde in ("naive", "cachegen"):
    config = load_config(
        {
            "chunk_size": CHUNK_SIZE,
            "max_local_cpu_size": 0.05,
            "local_disk": str(Path(workdir.name) / serde),
            "max_local_disk_size": 0.1,
            "remote_serde": serde,
        },
        env={},
    )
    engine = CacheEngine(config, EngineMetadata("compression-notebook"), paged_cache(kv))
    stored = engine.store(prompt, slot_mapping=slots)
    assert engine.flush(60), "the disk writes did not finish"
    engine.close()
    files = sorted(Path(workdir.name, serde).rglob("*.kvt"))
    disk_bytes[serde] = [path.stat().st_size for path in files]
    print(f"{serde:8s}: stored {stored.stored_chunks} chunks of {stored.stored_bytes // stored.stored_chunks:,} "
          f"bytes each; files on disk {disk_bytes[serde]}")  # fmt: skip
disk_ratio = sum(disk_bytes["naive"]) / sum(disk_bytes["cachegen"])
print(f"the cachegen disk tier holds the prompt in {disk_ratio:.2f}x fewer bytes")

fresh = paged_cache(None)
restarted = CacheEngine(config, EngineMetadata("compression-notebook"), fresh)
hit = restarted.lookup(prompt)
loaded = restarted.retrieve(prompt, slot_mapping=slots)
restarted.close()
tier_error, tier_fro = errors(kv, paged_kv(fresh))
same_as_codec = torch.equal(paged_kv(fresh), default_x_hat)
print(f"restarted on the cachegen directory: lookup {hit}, loaded {loaded} tokens")
print(f"loaded KV: max err/scale {tier_error:.4f} (bound {results['default']['bound']:.4f}), "
      f"identical to the codec's own round trip: {same_as_codec}")  # fmt: skip

# %% [markdown]
# ## Results
#
# Every schedule stays within its bound; error grows and so does the ratio as levels
# shrink; the default schedule compresses this KV at least 3× (about twice the int8
# baseline) with a worst case of ~1/16 of a row's absmax; as a disk serde it stores the
# same prompt in at least 3× fewer bytes than `naive`, and what comes back from disk is
# exactly the codec's round trip.

# %%
for name, r in results.items():
    assert r["error"] <= r["bound"], f"{name}: error {r['error']} above its bound {r['bound']}"
uniform = [results[f"uniform n={n}"] for n in (32, 16, 8, 4)]
assert all(a["error"] < b["error"] for a, b in pairwise(uniform)), "error grows"
assert all(a["fro"] < b["fro"] for a, b in pairwise(uniform)), "so does Frobenius"
assert all(a["ratio"] < b["ratio"] for a, b in pairwise(uniform)), "ratio grows"
default = results["default"]
assert default["ratio"] >= 3.0
assert results["uniform n=16"]["ratio"] < default["ratio"] < results["uniform n=8"]["ratio"]
assert default["error"] <= 1 / 16 + SLACK
assert 1.98 < int8["ratio"] < 2.0 and int8["error"] <= 1 / 254 + SLACK
assert default["ratio"] > 1.5 * int8["ratio"]
assert PLOT.stat().st_size > 10_000

assert len(disk_bytes["naive"]) == len(disk_bytes["cachegen"]) == TOKENS // CHUNK_SIZE
assert sum(disk_bytes["naive"]) > RAW_BYTES  # the raw bytes plus a small header per file
assert disk_ratio >= 3.0
assert hit == loaded == TOKENS
assert tier_error <= default["bound"] and same_as_codec
workdir.cleanup()
print("all results as expected")
