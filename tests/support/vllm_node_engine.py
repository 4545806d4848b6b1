"""A real vLLM engine (CPU build) in a process of its own, driven by JSON lines on stdin:
the engines of ``test_vllm_node_server.py`` and ``test_vllm_pd.py`` (``support.engine_process``).

    python tests/support/vllm_node_engine.py MODEL ENGINE_ID KVTIER_EXTRA_JSON [KV_ROLE]

It prints ``{"ready": true}`` once the engine is up, then answers one line per command:

    {"op": "generate", "prompts": [[ids...]], "max_tokens": 8}
        → {"results": [[output ids, num_cached_tokens, finish reason]...], "seconds": s}
    {"op": "reset"}   → vLLM's own prefix cache emptied (kvtier's tiers kept)
    {"op": "stats"}   → the kvtier worker's counters
    {"op": "chunk_names", "prompt": [ids...]}
        → {"names": [...]} the store names of the prompt's whole chunks (only with the
          worker in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0)
    {"op": "quit"}    → the engine shut down (kvtier's queued writes flushed), then exit
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: ``support``

from support.engines import generate, make_llm, shutdown, worker_stats


def chunk_names(prompt: list[int]) -> list[str]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    engine = get_kv_transfer_group()._worker.engine
    return [key.to_string() for key in engine.chunk_keys(prompt)]


def main(model: str, engine_id: str, extra_json: str, kv_role: str = "kv_both") -> None:
    # Replies own stdout; everything else printed to it (vLLM logs there, and so do the
    # processes it starts, which inherit fd 1) goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    llm = make_llm(
        Path(model),
        block_size=32,
        engine_id=engine_id,
        kvtier=json.loads(extra_json),
        kv_role=kv_role,
    )
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    try:
        for line in sys.stdin:
            command = json.loads(line)
            op = command["op"]
            if op == "generate":
                start = time.monotonic()
                results = generate(llm, command["prompts"], command.get("max_tokens", 8))
                reply = {
                    "results": [
                        [list(r.token_ids), r.num_cached_tokens, r.finish_reason] for r in results
                    ],
                    "seconds": time.monotonic() - start,
                }
            elif op == "reset":
                reply = {"reset": llm.reset_prefix_cache()}
            elif op == "stats":
                reply = worker_stats(engine_id)
            elif op == "chunk_names":
                reply = {"names": chunk_names(command["prompt"])}
            elif op == "quit":
                break
            else:
                reply = {"error": f"unknown op {op!r}"}
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        shutdown(llm)


if __name__ == "__main__":
    main(*sys.argv[1:5])
