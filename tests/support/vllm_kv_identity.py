"""Run by test_vllm_kv_identity.py in a fresh process: in-process vLLM engines whose KV
blocks ``KVProbe`` reads back (per layer, per block digests).

1. An engine with kvtier serves a batch cold (kvtier stores it), then again after vLLM's
   prefix cache is reset (kvtier loads it): the loaded blocks must equal the cold ones.
2. One bit of one loaded block is flipped in the engine: the probe must see it there.
3. An engine without any connector serves the same batch cold: its KV must equal the
   kvtier engine's cold KV, block for block (storing never touches the KV it reads).
4. With ``window`` (a sliding-window model): a prompt whose first chunks kvtier never
   stored (vLLM's own hit covered them) is served from kvtier alone: only the chunks of
   its window are loaded, bit-identical to a cold run's blocks there, and it generates
   the tokens of a run that vLLM's own prefix cache resumes at the same token.
5. vLLM's own cache holds a prompt's first 160 tokens (inside its third chunk) while kvtier
   lost its first chunk from every tier: kvtier loads the rest of the third chunk and the
   chunks after it, bit-identical to the cold prefill.

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
    local = local_hit(llm, probe, prompts[0], cold_kv[0], block)
    shutdown(llm)

    llm, probe = run(None)
    plain = generate(llm, prompts)
    plain_kv = [probe.digests(p) for p in prompts]
    shutdown(llm)
    window = window_hit(config["window"]) if "window" in config else None
    with open(out_path, "w") as f:
        json.dump(
            {
                "window": window,
                "local": local,
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


def local_hit(llm, probe, prompt: list[int], cold, block: int) -> dict:
    """Case 5 in the engine of case 1, whose kvtier holds every whole chunk of ``prompt``
    (``cold``: its cold prefill's digests)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from support.engines import generate

    own = 160
    assert llm.reset_prefix_cache()
    generate(llm, [prompt[:own]], max_tokens=1)  # vLLM's own cache: its first 5 blocks
    engine = get_kv_transfer_group()._worker.engine
    assert engine.storage.remove(engine.chunk_keys(prompt)[0]), "chunk 0 was not stored"
    cached = generate(llm, [prompt], max_tokens=1)[0].num_cached_tokens
    warm = probe.digests(prompt)
    differ = (
        (layer, i)
        for layer in range(len(cold.per_layer))
        for i in range(own // block, cached // block)  # the loaded blocks
        if cold.per_layer[layer][i] != warm.per_layer[layer][i]
    )
    return {"cached": cached, "mismatch": next(differ, None)}


def window_hit(config: dict) -> dict:
    """Case 4: ``config`` names a sliding-window model, its block and chunk sizes, the
    prompt, and how many of its first tokens (``shared``) kvtier is to lack."""
    import uuid

    from kvtier.integration.vllm.kv_probe import KVProbe
    from kvtier.integration.vllm.rpc import RpcClient, endpoint_for
    from support.engines import generate, make_llm, shutdown

    prompt, block = config["prompt"], config["block_size"]
    engine_id = f"kvtier-test-{uuid.uuid4().hex[:8]}"
    kvtier = {"chunk_size": config["chunk_size"]}
    llm = make_llm(config["model"], block_size=block, kvtier=kvtier, engine_id=engine_id)
    probe = KVProbe(llm)

    def clear_kvtier() -> None:
        with RpcClient([endpoint_for(f"{engine_id}-dp0", 0)], timeout=10.0) as client:
            assert client.call_all("clear") is not None

    generate(llm, [prompt[: config["shared"]]], max_tokens=1)
    clear_kvtier()
    generate(llm, [prompt], max_tokens=1)  # vLLM's own hit: kvtier stores what follows
    stored = probe.digests(prompt)
    assert llm.reset_prefix_cache()
    # One new token: the window's blocks are still the request's when it finishes.
    loaded = generate(llm, [prompt], max_tokens=1)[0].num_cached_tokens
    warm, warm_blocks = probe.digests(prompt), probe.block_ids(prompt)
    window = [b for b in range(loaded // block) if warm_blocks[b] != 0]
    assert llm.reset_prefix_cache()
    warm_tokens = generate(llm, [prompt])[0].token_ids
    clear_kvtier()
    assert llm.reset_prefix_cache()
    generate(llm, [prompt], max_tokens=1)
    cold = probe.digests(prompt)
    alike = generate(llm, [prompt])[0]  # vLLM's own prefix cache resumes it
    shutdown(llm)

    def mismatch(a, b) -> tuple[int, int] | None:
        layers = range(len(a.per_layer))
        differ = (
            (layer, i)
            for layer in layers
            for i in window
            if a.per_layer[layer][i] != b.per_layer[layer][i]
        )
        return next(differ, None)

    return {
        "loaded": loaded,
        "loaded_blocks": window,
        "loaded_vs_stored": mismatch(warm, stored),
        "loaded_vs_cold": mismatch(warm, cold),
        "alike_cached": alike.num_cached_tokens,
        "tokens_equal": warm_tokens == alike.token_ids,
    }


def _uint8():
    import torch

    return torch.uint8


if __name__ == "__main__":
    main()
