"""The keys of the vLLM connector's own behaviour: the engine's KV layout and how it is
moved, loading, saving, and the roles of prefill/decode disaggregation (``kv_producer`` /
``kv_consumer``, docs/disaggregated.md)."""

from __future__ import annotations

from kvtier.config.keys import KeySpec
from kvtier_kernels.layouts import LAYOUTS

# The engine's KV layout, and whether it moves one layer at a time.
KV_MOVEMENT: tuple[KeySpec, ...] = (
    KeySpec(
        "kv_layout",
        str,
        None,
        "vLLM connector: the engine's KV layout (a kvtier_kernels layout name); null "
        "detects it from vLLM's attention backend and the tensors.",
        choices=tuple(LAYOUTS),
        nullable=True,
    ),
    KeySpec(
        "use_layerwise",
        bool,
        False,
        "vLLM connector: move KV one layer at a time (loads finish just before each "
        "layer's attention, saves start right after it) instead of all layers per step.",
        lmcache_names=("use_layerwise",),
    ),
)


# Loading, saving, failures and the waits of prefill/decode disaggregation.
CONNECTOR: tuple[KeySpec, ...] = (
    KeySpec(
        "enable_async_loading",
        bool,
        False,
        "vLLM connector: load hits in the background while the scheduler runs other "
        "requests; the request is scheduled once its KV is in place.",
        lmcache_names=("enable_async_loading",),
    ),
    KeySpec(
        "save_decode_cache",
        bool,
        False,
        "vLLM connector: also store chunks filled by generated (decode-phase) tokens.",
        lmcache_names=("save_decode_cache",),
    ),
    KeySpec(
        "lookup_timeout_ms",
        int,
        2000,
        "vLLM connector: how long the scheduler waits for the worker ranks to answer a "
        "lookup; a slower or failed answer is a miss.",
        check=lambda v: 1 <= v <= 600_000,
        allowed="an integer from 1 to 600000 (milliseconds)",
        lmcache_names=("lookup_timeout_ms",),
    ),
    KeySpec(
        "min_retrieve_tokens",
        int,
        0,
        "vLLM connector: ignore a kvtier hit shorter than this many tokens (recompute it "
        "instead); 0 loads every hit.",
        check=lambda v: v >= 0,
        allowed="an integer >= 0",
        lmcache_names=("min_retrieve_tokens",),
    ),
    KeySpec(
        "kv_load_failure_policy",
        str,
        "recompute",
        "vLLM connector: a chunk that was found but cannot be loaded (corrupt, gone, a tier "
        "failing mid-load): recompute its tokens, or fail the request with an error (vLLM's "
        "kv_load_failure_policy 'fail'). A chunk not found is always recomputed.",
        choices=("recompute", "fail"),
    ),
    KeySpec(
        "pd_wait_ms",
        int,
        0,
        "kv_consumer: how long a request whose prompt kvtier does not fully hold yet waits "
        "(other requests run meanwhile) for a producer's store in flight; 0: no wait.",
        check=lambda v: 0 <= v <= 600_000,
        allowed="an integer from 0 to 600000 (milliseconds)",
    ),
    KeySpec(
        "producer_store_timeout_ms",
        int,
        30_000,
        "kv_producer: how long a step waits for its stores to reach every tier, so that "
        "a response means its KV is stored; a store still running then finishes in the "
        "background (counted). 0: do not wait.",
        check=lambda v: 0 <= v <= 600_000,
        allowed="an integer from 0 to 600000 (milliseconds)",
    ),
)
