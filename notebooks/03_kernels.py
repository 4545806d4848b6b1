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
# # The kernels: layouts, torch reference vs Triton, tuning
#
# Every byte kvtier moves between an engine's paged KV cache and its own chunks goes
# through two ops, `paged_gather` (engine pages → chunk) and `paged_scatter` (chunk →
# engine pages); a third, `rope_rerotate`, moves cached keys to new positions. Each op has
# a torch reference, which *defines* what is correct, and a Triton kernel. On a GPU the
# kernel is compiled; on a CPU it runs in Triton's interpreter (backend `interpret`), which
# is slow (about a millisecond per program) but runs the very same kernel code, so the
# shapes here are tiny.
#
# This notebook shows (1) what an engine layout is, by comparing vLLM's CPU layout with
# flash-attention's NHD layout; (2) the Triton kernels against the reference, bit for bit;
# (3) how the kernel backends are inspected and tuned with the `kvtier` CLI.

# %%
import json
import os
import subprocess
import sys
import tempfile

import torch

from kvtier_kernels import PagedKV, gather, registry, rerotate, scatter
from kvtier_kernels.dtypes import bits
from kvtier_kernels.paged.copy import launch_config

# %% [markdown]
# ## 1. Layouts: one logical cache, different bytes
#
# Whatever the engine, a token's KV is addressed by `slot = block * block_size + offset`.
# What differs is where K and V of a slot sit in the engine's tensors. kvtier names each
# layout and reduces every layer to one strided **canonical view**
# `[KV, num_blocks, block_size, num_heads, head_size]`, built from the tensor's real strides
# with no copy. Here is a 1-layer cache of 2 blocks of 4 slots, 2 heads of size 4, whose
# every value encodes its own address: `kv·10000 + block·1000 + slot·100 + head·10 + dim`.

# %%
NB, BS, H, D = 2, 4, 2, 4


def labelled_cache(layout: str) -> PagedKV:
    paged = PagedKV.empty(
        layout,
        num_layers=1,
        num_blocks=NB,
        block_size=BS,
        num_heads=H,
        head_size=D,
        dtype=torch.float32,
    )
    kv, block, slot, head, dim = torch.meshgrid(
        *(torch.arange(n) for n in (2, NB, BS, H, D)), indexing="ij"
    )
    label = kv * 10000 + block * 1000 + slot * 100 + head * 10 + dim
    paged.layer_view(0).copy_(label.float())  # written through the canonical view
    return paged


caches = {name: labelled_cache(name) for name in ("vllm_cpu", "flash_nhd")}
for name, paged in caches.items():
    tensor, view = paged.tensors[0], paged.layer_view(0)
    print(f"{name}: engine dims {paged.layout.dims}, tensor {tuple(tensor.shape)}")
    print(f"  canonical view {tuple(view.shape)}, strides {view.stride()}")

# %% [markdown]
# **flash_nhd** is the plain case: per layer `[2, NB, BS, H, D]`; `t[0]` is K, `t[1]` is V,
# and a slot's heads sit next to each other. Block 0 of K, one row per slot:

# %%
print(caches["flash_nhd"].tensors[0][0, 0].reshape(BS, H * D).int())

# %% [markdown]
# **vllm_cpu** (vLLM 0.32+ CPU backend) has the logical shape `[NB, H, BS, 2·D]` that looks
# like "K and V packed in the last dim", but it is not: for each (block, head) the region
# holds BS rows of K, then BS rows of V. Block 0, head 0, read as vLLM's tensor
# `[BS, 2·D]` — the first two rows are all K (slots 0-1, then 2-3), the last two all V:

# %%
print(caches["vllm_cpu"].tensors[0][0, 0].int())

# %% [markdown]
# That is why kvtier never guesses a layout from a shape: FlashAttention's `vllm_nhd` has
# the same logical shape and puts K in `[..., :D]`. Through the canonical views both
# caches gather into the **same** kvtier chunk (`KV_2LTD`: `[2, layers, tokens, H·D]`).

# %%
slots = torch.tensor([5, 0, 7, 2])  # block 1 slot 1, block 0 slot 0, ...
chunks = {}
for name, paged in caches.items():
    chunks[name] = torch.empty(paged.chunk_shape(len(slots)), dtype=paged.dtype)
    gather(paged, slots, chunks[name], backend="torch")
print("K rows of the chunk (token, H·D):")
print(chunks["vllm_cpu"][0, 0].int())
same_chunk = torch.equal(chunks["vllm_cpu"], chunks["flash_nhd"])
print("vllm_cpu and flash_nhd give the same chunk:", same_chunk)

# %% [markdown]
# ## 2. The Triton kernels against the torch reference
#
# `gather` and `scatter` take `backend=`: `torch` (the reference), `triton` (compiled, on
# a GPU) or `interpret` (the same kernels in Triton's interpreter, CPU tensors). Copies
# move rows as integer words, so they must be **bit-exact**, for every layout, including
# bf16 and a negative (skipped) slot. The comparison below views the bf16 values as
# 16-bit integers: it compares bits, not floats (float equality would miss -0.0 vs 0.0 and
# fail on any NaN).

# %%
print("backends:", registry.available_backends())
print("auto on a CPU tensor picks:", registry.resolve_backend("auto", "cpu"))


def random_cache(layout: str, seed: int) -> PagedKV:
    paged = PagedKV.empty(
        layout,
        num_layers=3,
        num_blocks=6,
        block_size=4,
        num_heads=2,
        head_size=8,
        dtype=torch.bfloat16,
    )
    gen = torch.Generator().manual_seed(seed)
    for tensor in paged.tensors:
        tensor.copy_(torch.randn(tensor.shape, generator=gen).to(tensor.dtype))
    return paged


LAYOUTS = ("vllm_cpu", "vllm_nhd", "flash_nhd", "flashinfer_hnd")
gen = torch.Generator().manual_seed(2)
slot_mapping = torch.tensor([9, 3, -1, 22, 0, 17, 4])  # -1: a padding token, skipped
exact: dict[tuple[str, str], bool] = {}
padding_untouched = True
for layout in LAYOUTS:
    paged = random_cache(layout, seed=0)
    shape = paged.chunk_shape(len(slot_mapping))
    # gather: engine pages -> chunk (the skipped token's row must stay untouched: zeros)
    ref = gather(paged, slot_mapping, torch.zeros(shape, dtype=paged.dtype), backend="torch")
    tri = gather(paged, slot_mapping, torch.zeros(shape, dtype=paged.dtype), backend="interpret")
    exact[layout, "gather"] = torch.equal(bits(ref), bits(tri))
    padding_untouched &= bool((bits(tri)[:, :, 2] == 0).all())
    # scatter: chunk -> engine pages of two identical caches; every other slot unchanged
    chunk = torch.randn(shape, generator=gen).to(paged.dtype)
    into_ref, into_tri = random_cache(layout, seed=1), random_cache(layout, seed=1)
    scatter(into_ref, slot_mapping, chunk, backend="torch")
    scatter(into_tri, slot_mapping, chunk, backend="interpret")
    exact[layout, "scatter"] = all(
        torch.equal(bits(a), bits(b))
        for a, b in zip(into_ref.tensors, into_tri.tensors, strict=True)
    )
    print(
        f"{layout:15s} gather bit-exact: {exact[layout, 'gather']}, "
        f"scatter bit-exact: {exact[layout, 'scatter']}"
    )

# %% [markdown]
# RoPE re-rotation computes in fp32 and rounds once to the storage dtype; its contract is
# *within one ulp* of the reference, not bit-exact: a kernel's `sin`/`cos` and the order
# of its fp32 operations need not match torch's, and a value that lands near a rounding
# boundary can round the other way. Counted in bf16 ulps, over 2 layers x 5 tokens x
# 2 heads of size 64, moved by 1000 positions:

# %%
keys = torch.randn(2, 5, 2 * 64, generator=gen).to(torch.bfloat16)
old_positions, new_positions = torch.arange(5), torch.arange(5) + 1000
ref_keys, tri_keys = keys.clone(), keys.clone()
rerotate(ref_keys, old_positions, new_positions, head_size=64, backend="torch")
rerotate(tri_keys, old_positions, new_positions, head_size=64, backend="interpret")
ulps = (bits(ref_keys).int() - bits(tri_keys).int()).abs()
rope_max_ulps = int(ulps.max())
print(f"rope: {int((ulps == 0).sum())} of {ulps.numel()} values bit-exact, max {rope_max_ulps} ulp")

# %% [markdown]
# ## 3. Launch parameters and tuning
#
# Each Triton launch needs a tile size and a warp count. There is no `@triton.autotune`
# (its first-call benchmarking would stall a serving engine): a launcher uses a per-GPU
# tuning file when one matches, else a heuristic. For a Llama-3-8B row (8 KV heads x 128
# bf16 = 2 KiB = 256 int64 words), the heuristic on a GPU and under the interpreter:

# %%
for device in ("cuda", "cpu"):
    config = launch_config("paged_gather", 256, torch.int64, torch.device(device), tuned=False)
    print(f"{device:5s} {config}")

# %% [markdown]
# `kvtier kernels` shows, on the machine it runs on, which backends work, what `auto`
# picks for each op and which tuning files are in effect (here: none, a CPU).

# %%
tuning_dir = tempfile.TemporaryDirectory(prefix="kvtier-tuning-")
cli_env = {**os.environ, "KVTIER_TUNING_DIR": tuning_dir.name}


def kvtier_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args],
        capture_output=True,
        text=True,
        env=cli_env,
        timeout=120,
    )


kernels = kvtier_cli("kernels")
print(kernels.stdout)
kernels_json = json.loads(kvtier_cli("kernels", "--json").stdout)

# %% [markdown]
# On a GPU machine, `kvtier tune` sweeps each op's launch parameters for one model's KV
# shape, checks **every candidate against the torch reference before timing it**, times
# the rest with CUDA/HIP events, and writes the fastest per op as JSON files that the
# launchers load from then on (`~/.cache/kvtier/tuning`, or `KVTIER_TUNING_DIR`):
#
# ```bash
# kvtier tune --model-config /models/Llama-3.1-8B-Instruct/config.json
# kvtier tune --layers 32 --kv-heads 8 --head-size 128 --dtype bfloat16 \
#             --block-size 16 --chunk-size 256 --layout vllm_nhd
# kvtier tune --model-config config.json --quick --ops paged_gather,paged_scatter --out ./tuning
# kvtier kernels      # now lists the files in effect for this GPU
# ```
#
# It prints one line per candidate to stderr and a summary to stdout, and also measures
# from which size on the DMA copy engine beats the kernel. See `docs/kernels.md` for the
# file format. Timings of the interpreter say nothing about a GPU, so on this machine it
# refuses, with exit status 2, and writes nothing:

# %%
tune = kvtier_cli("tune", "--quick")
print("exit status:", tune.returncode)
print(tune.stderr)
tuning_files = os.listdir(tuning_dir.name)
tuning_dir.cleanup()

# %% [markdown]
# ## Results

# %%
assert same_chunk  # two layouts, one chunk
assert chunks["flash_nhd"][0, 0, 0, 0] == 1100  # token 0 is slot 5: K, block 1, slot 1, head 0
assert chunks["flash_nhd"][1, 0, 1, D] == 10010  # token 1 is slot 0: V, block 0, head 1
for (layout, op), ok in exact.items():
    assert ok, f"{op} on {layout}: the interpreted Triton kernel differs from the reference"
assert len(exact) == 2 * len(LAYOUTS)
assert padding_untouched  # the token with slot -1 was neither read nor written
assert rope_max_ulps <= 1
assert registry.resolve_backend("auto", "cpu") == "torch"

assert kernels.returncode == 0
assert set(kernels_json["ops"]) == {
    "paged_gather",
    "paged_scatter",
    "rope_rerotate",
    "rans_encode",
    "rans_decode",
}
if kernels_json["device"] == "cpu":  # this machine has no GPU (CI's case)
    assert "interpret  available" in kernels.stdout
    # every op has a numba CPU kernel (paged copies, CacheGen's rANS, RoPE): auto picks it
    # where numba imports
    numba = kernels_json["kernel_backends"]["numba"].startswith("available")
    for name, op in kernels_json["ops"].items():
        assert op["auto"] == ("numba" if numba else "torch"), (name, op["auto"])
    assert all(op["tuning_files"] == [] for op in kernels_json["ops"].values())
    assert tune.returncode == 2, tune.stderr
    assert "needs a CUDA or ROCm GPU" in tune.stderr and tune.stdout == ""
    assert tuning_files == []  # nothing written
else:
    print("a GPU is present: `kvtier tune` tunes the kernels for it")
print("all results as expected")
