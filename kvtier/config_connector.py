"""The keys of the vLLM connector's own behaviour: loading, saving, and the roles of
prefill/decode disaggregation (``kv_producer`` / ``kv_consumer``, docs/disaggregated.md).

``KVTierConfig`` (``config``) inherits them; they are listed after its own keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.config_blend import BlendKeys
from kvtier.config_keys import key


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectorKeys(BlendKeys):
    """The vLLM connector's keys (a base of ``KVTierConfig``); CacheBlend's keys come
    from ``config_blend.BlendKeys``."""

    enable_async_loading: bool = key(
        False,
        bool,
        "vLLM connector: load hits in the background while the scheduler runs other "
        "requests; the request is scheduled once its KV is in place.",
        lmcache_names=("enable_async_loading",),
    )
    save_decode_cache: bool = key(
        False,
        bool,
        "vLLM connector: also store chunks filled by generated (decode-phase) tokens.",
        lmcache_names=("save_decode_cache",),
    )
    lookup_timeout_ms: int = key(
        2000,
        int,
        "vLLM connector: how long the scheduler waits for the worker ranks to answer a "
        "lookup; a slower or failed answer is a miss.",
        check=lambda v: 1 <= v <= 600_000,
        allowed="an integer from 1 to 600000 (milliseconds)",
        lmcache_names=("lookup_timeout_ms",),
    )
    min_retrieve_tokens: int = key(
        0,
        int,
        "vLLM connector: ignore a kvtier hit shorter than this many tokens (recompute it "
        "instead); 0 loads every hit.",
        check=lambda v: v >= 0,
        allowed="an integer >= 0",
        lmcache_names=("min_retrieve_tokens",),
    )
    kv_load_failure_policy: str = key(
        "recompute",
        str,
        "vLLM connector: a chunk that was found but cannot be loaded (corrupt, gone, a tier "
        "failing mid-load): recompute its tokens, or fail the request with an error (vLLM's "
        "kv_load_failure_policy 'fail'). A chunk not found is always recomputed.",
        choices=("recompute", "fail"),
    )
    pd_wait_ms: int = key(
        0,
        int,
        "kv_consumer: how long a request whose prompt kvtier does not fully hold yet waits "
        "(other requests run meanwhile) for a producer's store in flight; 0: no wait.",
        check=lambda v: 0 <= v <= 600_000,
        allowed="an integer from 0 to 600000 (milliseconds)",
    )
    producer_store_timeout_ms: int = key(
        30_000,
        int,
        "kv_producer: how long a step waits for its stores to reach every tier, so that "
        "a response means its KV is stored; a store still running then finishes in the "
        "background (counted). 0: do not wait.",
        check=lambda v: 0 <= v <= 600_000,
        allowed="an integer from 0 to 600000 (milliseconds)",
    )
