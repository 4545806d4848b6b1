"""LMCache compatibility: how kvtier reads LMCache's config keys.

LMCache names are matched case-sensitively, as LMCache spells them. A kvtier key that
shares LMCache's name or takes an LMCache alias says so in its ``KeySpec``
(``lmcache_names``); every other LMCache key is listed in one of the tables below:

- ``LMCACHE_NO_EFFECT_KEYS``: operational knobs that mean nothing in kvtier; accepted with
  any value, ignored, and reported in one warning per ``load_config`` call;
- ``LMCACHE_UNSUPPORTED_KEYS`` (and ``LMCACHE_UNSUPPORTED_PREFIXES``): features kvtier
  does not implement; accepted only while switched off (:func:`is_switched_off`);
- ``LMCACHE_PLANNED_KEYS``: features kvtier will gain as real keys; same rule, but the
  error says "not supported yet".

The tables are data, so that a later change moves a key from "planned" to a real
``KVTierConfig`` field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvtier.config.keys import KeySpec, yaml_literal

# Operational knobs with no meaning in kvtier: accepted with any value, ignored, and
# reported in one warning per load_config call.
LMCACHE_NO_EFFECT_KEYS: frozenset[str] = frozenset(
    {
        "lmcache_instance_id",
        "py_enable_gc",
        "numa_mode",
        "extra_config",
        "priority_limit",
        "save_only_first_rank",
        "internal_api_server_enabled",
        "internal_api_server_host",
        "internal_api_server_port_start",
        "internal_api_server_include_index_list",
        "internal_api_server_socket_path_prefix",
        "plugin_locations",
        "runtime_plugin_locations",
        "audit_actual_remove",
        "audit_actual_remote_url",
        "pre_caching_hash_algorithm",
        "pin_timeout_sec",
        "pin_check_interval_sec",
        "use_gpu_connector_v3",
        "local_cpu_use_hugepages",
        "reserve_local_cpu_size",
        "enable_lazy_memory_allocator",
        # kvtier shards the disk tree by key hash; ranks are told apart by their keys.
        "local_disk_path_sharding",
        # kvtier's remote waits are bounded by remote_timeout_ms (milliseconds).
        "blocking_timeout_secs",
        "lazy_memory_initial_ratio",
        "lazy_memory_expand_trigger_ratio",
        "lazy_memory_step_ratio",
        "lazy_memory_safe_size",
        "enable_chunk_statistics",
        "chunk_statistics_auto_start_statistics",
        "chunk_statistics_auto_exit_timeout_hours",
        "chunk_statistics_auto_exit_target_unique_chunks",
        "chunk_statistics_strategy",
        "cost_aware_half_life_seconds",
        "cost_aware_ewma_alpha",
        "hit_miss_ratio",
        "script_allowed_imports",
        "app_id",
        # LMCache v0's, still in LMCache's examples; LMCache v1 ignores it too.
        "pipelined_backend",
    }
)

# LMCache features kvtier does not implement: key -> (feature, LMCache's default value).
# Accepted silently while switched off (see is_switched_off); an error otherwise.
LMCACHE_UNSUPPORTED_KEYS: dict[str, tuple[str, Any]] = {
    # CacheBlend options kvtier does not have (its own keys: config.blend)
    "blend_thresholds": ("CacheBlend blending", None),
    "blend_separator": ("CacheBlend blending", "[BLEND_SEP]"),
    "blend_add_special_in_precomp": ("CacheBlend blending", False),
    # P2P sharing between instances
    "enable_p2p": ("P2P cache sharing", False),
    "p2p_host": ("P2P cache sharing", None),
    "p2p_init_ports": ("P2P cache sharing", None),
    "p2p_lookup_ports": ("P2P cache sharing", None),
    "lookup_url": ("P2P cache sharing", None),
    "distributed_url": ("P2P cache sharing", None),
    # Controller
    "enable_controller": ("the LMCache controller", False),
    "controller_url": ("the LMCache controller", None),
    "controller_pull_url": ("the LMCache controller", None),
    "controller_reply_url": ("the LMCache controller", None),
    "lmcache_worker_port": ("the LMCache controller", None),
    "lmcache_worker_ports": ("the LMCache controller", None),
    "lmcache_worker_ids": ("the LMCache controller", None),
    "lmcache_worker_heartbeat_delay_time": ("the LMCache controller", 10),
    "lmcache_worker_heartbeat_time": ("the LMCache controller", None),
    # Prefill/decode disaggregation
    "enable_pd": ("PD disaggregation", False),
    "enable_xpyd": ("PD disaggregation", False),
    "pd_role": ("PD disaggregation", None),
    "pd_buffer_size": ("PD disaggregation", None),
    "pd_buffer_device": ("PD disaggregation", None),
    "pd_peer_host": ("PD disaggregation", None),
    "pd_peer_init_port": ("PD disaggregation", None),
    "pd_peer_alloc_port": ("PD disaggregation", None),
    "pd_peer_query_port": ("PD disaggregation", None),
    "pd_proxy_host": ("PD disaggregation", None),
    "pd_proxy_port": ("PD disaggregation", None),
    "pd_allocation_timeout_sec": ("PD disaggregation", math.inf),
    "pd_shutdown_timeout_sec": ("PD disaggregation", 5.0),
    "pd_condition_poll_interval_sec": ("PD disaggregation", 0.005),
    "pd_max_prefill_len": ("PD disaggregation", 0),
    "pd_backend_mode": ("PD disaggregation", "async"),
    "pd_skip_proxy_notification": ("PD disaggregation", False),
    "pd_bidirectional": ("PD disaggregation", False),
    "transfer_channel": ("PD disaggregation", None),
    # NIXL (every other nixl_* key is caught by LMCACHE_UNSUPPORTED_PREFIXES)
    "enable_nixl": ("NIXL transfer", False),
    "nixl_enable_gc": ("NIXL transfer", True),
    # GPUDirect Storage, Weka, Maru
    "gds_path": ("GPUDirect Storage", None),
    "gds_path_sharding": ("GPUDirect Storage", "by_gpu"),
    "gds_buffer_size": ("GPUDirect Storage", None),
    "gds_backend": ("GPUDirect Storage", "cufile"),
    "use_gds": ("GPUDirect Storage", True),
    "cufile_buffer_size": ("GPUDirect Storage", None),
    "weka_path": ("the Weka backend", None),
    "maru_path": ("the Maru CXL backend", None),
    "maru_pool_size": ("the Maru CXL backend", 4.0),
    # Lookup, placement, plugins and other services
    "external_lookup_client": ("external lookup clients", None),
    "enable_scheduler_bypass_lookup": ("scheduler bypass lookup", False),
    "lookup_server_worker_ids": ("scheduler bypass lookup", None),
    "retrieve_locations": ("per-backend store/retrieve locations", None),
    "store_location": ("per-backend store/retrieve locations", None),
    "external_backends": ("storage plugins", None),
    "storage_plugins": ("storage plugins", None),
    "remote_storage_plugins": ("storage plugins", None),
    "remote_config_url": ("the remote configuration service", None),
    "enable_kv_events": ("KV cache events", False),
    "mp_host": ("the multi-process server", None),
    "mp_port": ("the multi-process server", 5555),
    "enable_hidden_state_cache": ("hidden-state caching", False),
    "max_hidden_state_cpu_size": ("hidden-state caching", 2.0),
    "hidden_state_layers": ("hidden-state caching", None),
    "hidden_states_retrieve_mode": ("hidden-state caching", "prefix_strict"),
    # LMCache v0's device of its one cache, still in LMCache's examples, ignored by LMCache
    # v1: "cpu" is kvtier's default CPU tier; any other device is refused, not dropped.
    "local_device": ("LMCache v0's local_device", "cpu"),
}

# Key-name prefixes of whole unsupported LMCache feature families: prefix -> feature.
# A kvtier key is never one of them (pd_wait_ms is kvtier's own).
LMCACHE_UNSUPPORTED_PREFIXES: dict[str, str] = {
    "nixl_": "NIXL transfer",
    "pd_": "PD disaggregation",
}

# LMCache features kvtier will gain as real keys: key -> (feature, LMCache's default).
# Same rule as LMCACHE_UNSUPPORTED_KEYS, but the error says "not supported yet".
LMCACHE_PLANNED_KEYS: dict[str, tuple[str, Any]] = {}


def lmcache_aliases(keys: Mapping[str, KeySpec]) -> dict[str, str]:
    """LMCache names that differ from the kvtier key they set: LMCache name -> kvtier key."""
    return {
        lmcache_name: spec.name
        for spec in keys.values()
        for lmcache_name in spec.lmcache_names
        if lmcache_name != spec.name
    }


def is_lmcache_feature_key(name: str) -> bool:
    """Whether ``name`` is a key of an LMCache feature kvtier lacks (unsupported or planned)."""
    return (
        name in LMCACHE_UNSUPPORTED_KEYS
        or name in LMCACHE_PLANNED_KEYS
        or name.startswith(tuple(LMCACHE_UNSUPPORTED_PREFIXES))
    )


# What kvtier offers instead of an unsupported LMCache feature, named in its error.
LMCACHE_FEATURE_INSTEAD = {
    "PD disaggregation": "kvtier's is vLLM's kv_role 'kv_producer' / 'kv_consumer' with one "
    "shared remote_url, see docs/disaggregated.md",
    "P2P cache sharing": "kvtier's is kvtier serve with peers (--peer, or server_peers), "
    "see docs/server.md",
    "the LMCache controller": "kvtier serve's admin API and kvtier status give lookups and "
    "stats, see docs/server.md",
    "GPUDirect Storage": "kvtier's disk tier is local_disk, with local_disk_o_direct",
    "LMCache v0's local_device": "LMCache v1 ignores it too; a file:// device is kvtier's "
    "local_disk: PATH, and the CPU tier is local_cpu",
}


def check_lmcache_feature_key(name: str, raw: Any, origin: str) -> str | None:
    """The problem with an unsupported/planned LMCache key's value, or None if it is off."""
    if name in LMCACHE_PLANNED_KEYS:
        (feature, default), verdict = LMCACHE_PLANNED_KEYS[name], "not supported yet"
    elif name in LMCACHE_UNSUPPORTED_KEYS:
        (feature, default), verdict = LMCACHE_UNSUPPORTED_KEYS[name], "not supported"
    else:
        prefix = next(p for p in LMCACHE_UNSUPPORTED_PREFIXES if name.startswith(p))
        feature, default, verdict = LMCACHE_UNSUPPORTED_PREFIXES[prefix], None, "not supported"
    if is_switched_off(raw, default):
        return None
    fix = "remove it" if default is None else f"remove it or set it to {yaml_literal(default)}"
    instead = LMCACHE_FEATURE_INSTEAD.get(feature)
    return (
        f"LMCache key {name!r} is {verdict} by kvtier ({feature}): got {raw!r} from {origin}; {fix}"
        + (f" ({instead})" if instead else "")
    )


def is_switched_off(value: Any, lmcache_default: Any) -> bool:
    """Whether a value of an unsupported/planned LMCache key leaves its feature off.

    Off means null, false, zero, an empty string/list/mapping, or LMCache's own default
    for the key (compared bool-to-bool, so ``true`` never matches a default of 1).
    """
    if value is None or value is False:
        return True
    if value is True:
        return lmcache_default is True
    if isinstance(value, int | float | str | list | dict) and not value:
        return True
    return not isinstance(lmcache_default, bool) and value == lmcache_default
