"""Run by test_vllm_parallel.py in a fresh process: one vLLM engine with kvtier and
tensor parallelism (worker processes, the engine core in this process for ``KVProbe``).

1. A batch is served cold (every rank stores its shard), then again after vLLM's prefix
   cache is reset (every rank loads its shard): each rank's loaded KV blocks must equal
   its cold ones, and the greedy tokens the cold ones.
2. Every rank's lookup socket answers.
3. One rank's tier is emptied: the next pass must load nothing, on any rank.

Usage: python vllm_parallel.py CONFIG_JSON OUT_JSON
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: ``support``

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
# vLLM's CPU build binds each worker's threads to a NUMA node of its own by default, and
# refuses two workers on a machine with one node ("Not enough allowed NUMA nodes")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def main() -> None:
    config = json.loads(sys.argv[1])
    out_path = sys.argv[2]
    from kvtier.integration.vllm.kv_probe import KVProbe, first_mismatch
    from kvtier.integration.vllm.rpc import RpcClient, endpoint_for
    from support.engines import generate, make_llm, shutdown

    shm_before = set(os.listdir("/dev/shm"))
    prompts, block, tp = config["prompts"], config["block_size"], config["tensor_parallel_size"]
    engine_id = f"kvtier-test-{uuid.uuid4().hex[:8]}"
    endpoints = [endpoint_for(f"{engine_id}-dp0", rank) for rank in range(tp)]
    llm = make_llm(
        config["model"],
        block_size=block,
        kvtier={"chunk_size": config["chunk_size"]},
        engine_id=engine_id,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp",
    )
    probe = KVProbe(llm)
    cold = generate(llm, prompts)
    cold_kv = [probe.digests(p) for p in prompts]
    with RpcClient(endpoints, timeout=10.0) as client:
        stats = client.call_all("stats")
    assert llm.reset_prefix_cache()
    warm = generate(llm, prompts)
    warm_kv = [probe.digests(p) for p in prompts]
    with RpcClient(endpoints[-1:], timeout=10.0) as client:
        cleared = client.call_all("clear")
    assert llm.reset_prefix_cache()
    after_clear = generate(llm, prompts)
    shutdown(llm)
    # vLLM's CPU build stops its workers with SIGTERM after a grace period (with or
    # without a connector), and they leave their tensor-parallel group's shared memory
    for name in set(os.listdir("/dev/shm")) - shm_before:
        if name.startswith("vllm_dist_"):
            os.unlink(os.path.join("/dev/shm", name))
    with open(out_path, "w") as f:
        json.dump(
            {
                "layers": len(cold_kv[0].per_layer),
                "stored_chunks": None if stats is None else [s["stored_chunks"] for s in stats],
                "loaded": [r.num_cached_tokens for r in warm],
                "loaded_mismatch": [
                    first_mismatch(c, w, num_blocks=r.num_cached_tokens // block)
                    for c, w, r in zip(cold_kv, warm_kv, warm, strict=True)
                ],
                "tokens": {
                    "cold": [list(r.token_ids) for r in cold],
                    "warm": [list(r.token_ids) for r in warm],
                },
                "cleared": cleared is not None,
                "loaded_after_clear": [r.num_cached_tokens for r in after_clear],
                "sockets_left": [e for e in endpoints if os.path.exists(e.removeprefix("ipc://"))],
            },
            f,
        )


if __name__ == "__main__":
    main()
