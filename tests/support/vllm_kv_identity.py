"""Run by test_vllm_kv_identity.py in a fresh process: in-process vLLM engines whose KV
blocks ``KVProbe`` reads back (per layer, per block digests).

1. An engine with kvtier serves a batch cold (kvtier stores it), then again after vLLM's
   prefix cache is reset (kvtier loads it): the loaded blocks must equal the cold ones.
2. One bit of one loaded block is flipped in the engine: the probe must see it there.
3. An engine without any connector serves the same batch cold: its KV must equal the
   kvtier engine's cold KV, block for block (storing never touches the KV it reads).

Usage: python vllm_kv_identity.py CONFIG_JSON OUT_JSON
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: ``support``

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine and worker in this process


def main() -> None:
    config = json.loads(sys.argv[1])
    out_path = sys.argv[2]
    from kvtier.integration.vllm.kv_probe import KVProbe, first_mismatch
    from support.engines import generate, make_llm, shutdown

    model, prompts = config["model"], config["prompts"]
    block, dtype = config["block_size"], config["dtype"]

    def run(kvtier):
        llm = make_llm(model, block_size=block, kvtier=kvtier, dtype=dtype)
        return llm, KVProbe(llm)

    llm, probe = run({"chunk_size": config["chunk_size"]})
    cold = generate(llm, prompts)
    cold_kv = [probe.digests(p) for p in prompts]  # hashed before the next batch reuses blocks
    assert llm.reset_prefix_cache()
    warm = generate(llm, prompts)
    warm_kv = [probe.digests(p) for p in prompts]
    loaded_mismatch = [
        first_mismatch(c, w, num_blocks=r.num_cached_tokens // block)
        for c, w, r in zip(cold_kv, warm_kv, warm, strict=True)
    ]
    # A flipped bit in the engine's copy of a loaded block must show, where it is.
    layer, flipped_block = len(probe.layer_caches()) - 1, 1
    target = probe.block_ids(prompts[0])[flipped_block]
    cache = probe.layer_caches()[layer]
    raw = cache[target].reshape(-1).view(_uint8())
    raw[5] ^= 0x01
    flipped = first_mismatch(warm_kv[0], probe.digests(prompts[0]), num_blocks=2)
    raw[5] ^= 0x01
    shutdown(llm)

    llm, probe = run(None)
    plain = generate(llm, prompts)
    plain_kv = [probe.digests(p) for p in prompts]
    shutdown(llm)
    with open(out_path, "w") as f:
        json.dump(
            {
                "loaded": [r.num_cached_tokens for r in warm],
                "loaded_mismatch": loaded_mismatch,
                "flipped": [flipped, [layer, flipped_block]],
                "connector_vs_plain_mismatch": [
                    first_mismatch(a, b, num_blocks=a.num_blocks)
                    for a, b in zip(cold_kv, plain_kv, strict=True)
                ],
                "tokens": {
                    "cold": [list(r.token_ids) for r in cold],
                    "warm": [list(r.token_ids) for r in warm],
                    "plain": [list(r.token_ids) for r in plain],
                },
            },
            f,
        )


def _uint8():
    import torch

    return torch.uint8


if __name__ == "__main__":
    main()
