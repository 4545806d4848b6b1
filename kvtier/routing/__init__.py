"""Cache-aware routing: which engine instance already holds a request's prefix.

Engines publish vLLM KV events (vLLM's own prefix cache, ``medium: GPU``, and kvtier's
tiers, ``ownership: "kvtier"``); ``kvtier proxy --policy cache_aware`` subscribes to them
and sends each request where the longest weighted prefix of its blocks is held.

    events        a subscriber per instance: vLLM's ZMQ stream, sequence gaps, replay
    index         block hash -> which instance holds it, on which medium (LRU-bounded)
    block_hashes  a request's token ids -> the block hashes vLLM computes for them
    scoring       the longest consecutive held prefix per instance, weighted by medium

Nothing here imports vLLM: the proxy runs where vLLM is not installed. The event classes
are msgspec mirrors of ``vllm.distributed.kv_events`` (tested against vLLM's publisher).
"""
