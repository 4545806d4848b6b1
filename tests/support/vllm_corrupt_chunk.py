"""Run by test_vllm_modes.py in a fresh process: an in-process vLLM engine (so the test
can reach the worker's store), a cold pass, one stored chunk corrupted, a warm pass.

Usage: python vllm_corrupt_chunk.py MODEL PROMPT_JSON CHUNK_INDEX OUT_JSON
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: ``support``

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine and worker in this process


def main() -> None:
    model, prompt_json, chunk_index, out_path = sys.argv[1:5]
    prompt = json.loads(prompt_json)
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from support.engines import generate, make_llm

    # the fault is injected in kvtier's own memory: checked in paranoid mode only
    llm = make_llm(model, block_size=32, kvtier={"chunk_size": 64, "verify_checksums": True})
    generate(llm, [prompt])
    worker = get_kv_transfer_group()._worker
    engine = worker.engine
    key = engine.chunk_keys(prompt)[int(chunk_index)]
    obj = engine.storage.get(key)  # the stored object itself: the fault is injected there
    assert obj is not None, "the chunk to corrupt was not stored"
    raw = obj.tensor.reshape(-1).view(torch_uint8())
    raw[:16] ^= 0x5A  # flip bits in place: the stored object itself changes
    obj.ref_down()
    assert llm.reset_prefix_cache()
    hits_before = worker.stats.get("retrieve_hit_tokens")
    (warm,) = generate(llm, [prompt])
    stats = worker.stats.snapshot()
    with open(out_path, "w") as f:
        json.dump(
            {
                "warm_tokens": list(warm.token_ids),
                "warm_loaded_tokens": stats["retrieve_hit_tokens"] - hits_before,
                "corrupt_chunks_rejected": stats.get("corrupt_chunks_rejected", 0),
            },
            f,
        )


def torch_uint8():
    import torch

    return torch.uint8


if __name__ == "__main__":
    main()
