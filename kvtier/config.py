"""kvtier configuration: one validated, immutable config object.

Every setting kvtier has is a field of :class:`KVTierConfig`, and every field carries a
:class:`KeySpec` (type, default, allowed values, help text, LMCache names). The registry
``CONFIG_KEYS`` is derived from those fields, so a new key is one new field.

``load_config`` merges four sources, highest precedence first::

    overrides      a mapping, e.g. vLLM's ``kv_transfer_config.kv_connector_extra_config``
    environment    ``KVTIER_<KEY>`` variables (``KVTIER_CHUNK_SIZE=512``)
    YAML file      ``config_file`` argument, else ``overrides["config_file"]``,
                   else ``$KVTIER_CONFIG_FILE``
    defaults       the ``KeySpec`` defaults

NOTE: this module is the only place in kvtier that reads environment variables, and it
reads them only inside ``load_config``.

LMCache configs load too: keys with the same meaning are accepted under LMCache's names,
operational LMCache knobs that mean nothing here are ignored with one warning, and LMCache
features kvtier does not have are accepted only while switched off. The tables below are
data so that a later change moves a key from "planned" to a real ``KVTierConfig`` field.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from kvtier_kernels.layouts import LAYOUTS

logger = logging.getLogger(__name__)

ENV_PREFIX = "KVTIER_"
CONFIG_FILE_KEY = "config_file"
CONFIG_FILE_ENV_VAR = "KVTIER_CONFIG_FILE"
# KVTIER_* variables that are not config keys; load_config accepts them without a value check.
RESERVED_ENV_VARS = frozenset({CONFIG_FILE_ENV_VAR, "KVTIER_LOG_LEVEL"})

GiB = 1 << 30  # sizes in GB are binary gigabytes (GiB, 2**30 bytes), as in LMCache

# --------------------------------------------------------------------------------------
# LMCache compatibility tables. LMCache names are matched case-sensitively, as LMCache
# spells them. kvtier keys that share LMCache's name or take an LMCache alias say so in
# their KeySpec (``lmcache_names``); every other LMCache key must be listed here.
# --------------------------------------------------------------------------------------

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
    }
)

# LMCache features kvtier does not implement: key -> (feature, LMCache's default value).
# Accepted silently while switched off (see _is_switched_off); an error otherwise.
LMCACHE_UNSUPPORTED_KEYS: dict[str, tuple[str, Any]] = {
    # CacheBlend
    "enable_blending": ("CacheBlend blending", False),
    "blend_recompute_ratio": ("CacheBlend blending", 0.15),
    "blend_recompute_ratios": ("CacheBlend blending", None),
    "blend_thresholds": ("CacheBlend blending", None),
    "blend_check_layers": ("CacheBlend blending", None),
    "blend_min_tokens": ("CacheBlend blending", 256),
    "blend_special_str": ("CacheBlend blending", " # # "),
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
}

# Key-name prefixes of whole unsupported LMCache feature families: prefix -> feature.
LMCACHE_UNSUPPORTED_PREFIXES: dict[str, str] = {"nixl_": "NIXL transfer"}

# LMCache features kvtier will gain as real keys: key -> (feature, LMCache's default).
# Same rule as LMCACHE_UNSUPPORTED_KEYS, but the error says "not supported yet".
LMCACHE_PLANNED_KEYS: dict[str, tuple[str, Any]] = {}


class ConfigError(ValueError):
    """The configuration is invalid; ``problems`` lists every problem found.

    Each problem names the key (or environment variable, or file), the offending value,
    where it came from and what is allowed.
    """

    def __init__(self, problems: str | Sequence[str]) -> None:
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = f"invalid kvtier configuration: {self.problems[0]}"
        else:
            listed = "".join(f"\n  - {p}" for p in self.problems)
            message = f"invalid kvtier configuration ({len(self.problems)} problems):{listed}"
        super().__init__(message)

    def __reduce__(self) -> tuple[type[ConfigError], tuple[list[str]]]:
        return (type(self), (self.problems,))


# --------------------------------------------------------------------------------------
# Key specs
# --------------------------------------------------------------------------------------

_SPEC = "kvtier.config.KeySpec"  # dataclass field-metadata slot holding a field's KeySpec
_ENV_TRUE = frozenset({"true", "1", "yes", "on"})
_ENV_FALSE = frozenset({"false", "0", "no", "off"})
_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


@dataclass(frozen=True, slots=True)
class KeySpec:
    """Everything kvtier knows about one config key.

    ``kind`` is one of bool, int, float, str. ``choices`` (str keys) are matched
    case-insensitively and stored in the spelling given here. ``check`` is a predicate on
    the typed value; ``allowed`` describes, for error messages and docs, what passes it.
    ``normalize`` runs before type checking (e.g. int -> str). ``lmcache_names`` lists the
    names LMCache uses for the same setting (its own name included when identical).
    """

    name: str
    kind: type
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    check: Callable[[Any], bool] | None = None
    allowed: str = ""
    nullable: bool = False
    normalize: Callable[[Any], Any] | None = None
    lmcache_names: tuple[str, ...] = ()
    secret: bool = False

    @property
    def env_var(self) -> str:
        """The environment variable that sets this key, e.g. ``KVTIER_CHUNK_SIZE``."""
        return ENV_PREFIX + self.name.upper()

    def describe_allowed(self) -> str:
        """Human-readable allowed values, e.g. ``one of LRU, LFU, FIFO, MRU``."""
        if self.allowed:
            text = self.allowed
        elif self.choices:
            text = "one of " + ", ".join(self.choices)
        else:
            text = _TYPE_NAMES[self.kind]
        return f"{text}, or null" if self.nullable else text


def _key(
    default: Any,
    kind: type,
    help: str,
    *,
    choices: Iterable[str] = (),
    check: Callable[[Any], bool] | None = None,
    allowed: str = "",
    nullable: bool = False,
    normalize: Callable[[Any], Any] | None = None,
    lmcache_names: Iterable[str] = (),
    secret: bool = False,
) -> Any:
    """A dataclass field carrying its KeySpec; the name is filled in from the field."""
    spec = KeySpec(
        name="",
        kind=kind,
        default=default,
        help=help,
        choices=tuple(choices),
        check=check,
        allowed=allowed,
        nullable=nullable,
        normalize=normalize,
        lmcache_names=tuple(lmcache_names),
        secret=secret,
    )
    return field(default=default, metadata={_SPEC: spec})


def _levels_text(value: Any) -> Any:
    """A levels schedule as text: YAML may give an int or a list of ints."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, list | tuple) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return ",".join(map(str, value))
    return value.replace(" ", "") if isinstance(value, str) else value


_LEVELS_ALLOWED = "empty, or comma-separated integers from 1 to 127 (one, or one per layer)"


def _valid_levels_text(text: str) -> bool:
    if not text:
        return True
    parts = text.split(",")
    return all(p.isdigit() and 1 <= int(p) <= 127 for p in parts)


def parse_levels(text: str, num_layers: int, key: str) -> list[int] | None:
    """The per-layer levels ``text`` (a ``cachegen_*_levels`` value) sets for a model of
    ``num_layers`` layers; None for the default schedule.

    Raises:
        ValueError: ``text`` lists a number of layers other than 1 or ``num_layers``
            (the message names ``key``).
    """
    if not text:
        return None
    levels = [int(p) for p in text.split(",")]
    if len(levels) == 1:
        return levels * num_layers
    if len(levels) != num_layers:
        raise ValueError(
            f"{key} lists {len(levels)} layers, the model has {num_layers}: give one "
            "integer for every layer or exactly one per layer"
        )
    return levels


REMOTE_SCHEMES = (
    "redis",
    "rediss",
    "redis-cluster",
    "valkey",
    "valkeys",
    "valkey-cluster",
    "unix",
    "s3",
    "fs",
)


def _strip_file_scheme(path: str) -> str:
    """LMCache spells ``local_disk`` as ``file:///path``; kvtier takes either."""
    return path[len("file://") :] if path.startswith("file://") else path


def _int_to_str(value: Any) -> Any:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


# --------------------------------------------------------------------------------------
# The config object
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class KVTierConfig:
    """kvtier's validated settings. Build it with :func:`load_config`.

    Constructing it directly (or through ``dataclasses.replace``) validates and normalizes
    every key too, raising :class:`ConfigError`; such a config has no recorded sources.
    ``ignored_lmcache_keys`` lists the no-effect LMCache keys the inputs contained.
    """

    chunk_size: int = _key(
        256,
        int,
        "Tokens per chunk: the unit of hashing, storage and transfer.",
        check=lambda v: 1 <= v <= 1 << 20,
        allowed="an integer from 1 to 1048576",
        lmcache_names=("chunk_size",),
    )
    local_cpu: bool = _key(
        True,
        bool,
        "Keep chunks in the pinned CPU memory tier.",
        lmcache_names=("local_cpu",),
    )
    max_local_cpu_size: float = _key(
        5.0,
        float,
        "Size of the pinned CPU memory pool in GB (binary: 1 GB = 2**30 bytes).",
        check=lambda v: math.isfinite(v) and v > 0,
        allowed="a finite number > 0 (GB = 2**30 bytes)",
        lmcache_names=("max_local_cpu_size", "max_local_cache_size"),
    )
    cache_policy: str = _key(
        "LRU",
        str,
        "Eviction policy of the CPU tier (case-insensitive).",
        choices=("LRU", "LFU", "FIFO", "MRU"),
        lmcache_names=("cache_policy",),
    )
    hash_algorithm: str = _key(
        "sha256_cbor",
        str,
        "Chunk hash: sha256_cbor (vLLM's prefix-cache hash) or xxh3_128 (fast).",
        choices=("sha256_cbor", "xxh3_128"),
    )
    hash_seed: str = _key(
        "vllm-none-hash",
        str,
        "Seed of the root hash of every chunk chain. Integers are converted to strings. "
        "The default is vLLM's own default seed for sha256_cbor; when vLLM runs with "
        "PYTHONHASHSEED set, use that value to reproduce its prefix hashes.",
        normalize=_int_to_str,
        allowed="a string (an integer is converted to a string)",
    )
    save_unfull_chunk: bool = _key(
        False,
        bool,
        "Also store the partial last chunk of a prompt.",
        lmcache_names=("save_unfull_chunk",),
    )
    kernel_backend: str = _key(
        "auto",
        str,
        "Kernel implementation: auto (Triton on a GPU Triton can drive, else torch), "
        "triton, interpret (Triton interpreter) or torch (reference kernels).",
        choices=("auto", "triton", "interpret", "torch"),
    )
    tuning_dir: str | None = _key(
        None,
        str,
        "Directory of per-device kernel tuning files (`kvtier tune --out`), searched before "
        "the built-in path (several: `os.pathsep`-separated); null: the built-in path only "
        "(`KVTIER_TUNING_DIR`, else `~/.cache/kvtier/tuning`, then packaged defaults). "
        "Applied process-wide when a `CacheEngine` is built.",
        check=lambda v: v != "",
        allowed="a non-empty string",
        nullable=True,
    )
    model_name: str | None = _key(
        None,
        str,
        "Model name used in storage keys; null takes it from the engine.",
        check=lambda v: v != "",
        allowed="a non-empty string",
        nullable=True,
    )
    pool_alignment: int = _key(
        256,
        int,
        "Byte alignment of buffers in the CPU memory pool.",
        check=lambda v: _is_power_of_two(v) and v <= 4096,
        allowed="a power of two from 1 to 4096",
    )
    verify_checksums: bool = _key(
        True,
        bool,
        "Checksum every stored chunk (xxh3-64) and verify it before the chunk is loaded "
        "into the engine; a mismatch is a miss, never wrong KV.",
    )
    kv_layout: str | None = _key(
        None,
        str,
        "vLLM connector: the engine's KV layout (a kvtier_kernels layout name); null "
        "detects it from vLLM's attention backend and the tensors.",
        choices=tuple(LAYOUTS),
        nullable=True,
    )
    use_layerwise: bool = _key(
        False,
        bool,
        "vLLM connector: move KV one layer at a time (loads finish just before each "
        "layer's attention, saves start right after it) instead of all layers per step.",
        lmcache_names=("use_layerwise",),
    )
    enable_async_loading: bool = _key(
        False,
        bool,
        "vLLM connector: load hits in the background while the scheduler runs other "
        "requests; the request is scheduled once its KV is in place.",
        lmcache_names=("enable_async_loading",),
    )
    save_decode_cache: bool = _key(
        False,
        bool,
        "vLLM connector: also store chunks filled by generated (decode-phase) tokens.",
        lmcache_names=("save_decode_cache",),
    )
    lookup_timeout_ms: int = _key(
        2000,
        int,
        "vLLM connector: how long the scheduler waits for the worker ranks to answer a "
        "lookup; a slower or failed answer is a miss.",
        check=lambda v: 1 <= v <= 600_000,
        allowed="an integer from 1 to 600000 (milliseconds)",
        lmcache_names=("lookup_timeout_ms",),
    )
    min_retrieve_tokens: int = _key(
        0,
        int,
        "vLLM connector: ignore a kvtier hit shorter than this many tokens (recompute it "
        "instead); 0 loads every hit.",
        check=lambda v: v >= 0,
        allowed="an integer >= 0",
        lmcache_names=("min_retrieve_tokens",),
    )
    metrics_port: int | None = _key(
        None,
        int,
        "Serve Prometheus metrics on this port (/metrics); null: off. Inside vLLM the "
        "scheduler process serves every rank's metrics; data-parallel engine i uses "
        "metrics_port + i.",
        check=lambda v: 0 <= v <= 65535,
        allowed="a port number from 0 to 65535 (0: any free port)",
        nullable=True,
    )
    metrics_host: str = _key(
        "127.0.0.1",
        str,
        "Address the metrics endpoint binds to (0.0.0.0 to let a remote Prometheus scrape).",
        check=lambda v: v != "",
        allowed="a host name or IP address",
    )
    store_queue_size: int = _key(
        256,
        int,
        "Chunks waiting to be written to each tier below the CPU (disk, remote); when "
        "the queue is full a store is dropped and counted, never waited for.",
        check=lambda v: 1 <= v <= 1 << 20,
        allowed="an integer from 1 to 1048576",
    )
    local_disk: str | None = _key(
        None,
        str,
        "Local disk tier: a directory (or file:// URL) for chunk files that survive "
        "restarts and are shared by the engines of this machine; null disables the tier.",
        normalize=lambda v: (_strip_file_scheme(v) or None) if isinstance(v, str) else v,
        allowed="a directory path or file:// URL (empty: null)",
        nullable=True,
        lmcache_names=("local_disk",),
    )
    max_local_disk_size: float = _key(
        20.0,
        float,
        "Size bound of the local disk tier in GB (2**30 bytes); the oldest chunk files "
        "are evicted (cache_policy order) to stay under it.",
        check=lambda v: math.isfinite(v) and v >= 0,
        allowed="a finite number >= 0 (GB = 2**30 bytes; > 0 when local_disk is set)",
        lmcache_names=("max_local_disk_size",),
    )
    local_disk_o_direct: bool = _key(
        False,
        bool,
        "Local disk tier: read and write with O_DIRECT (bypass the page cache); falls "
        "back to buffered I/O with a warning where the filesystem refuses it.",
    )
    remote_url: str | None = _key(
        None,
        str,
        "Remote tier shared by many engines: redis://[user:pass@]host:port/db, rediss:// "
        "(TLS), redis-cluster://host:port[,host:port], valkey:// (and valkeys://, "
        "valkey-cluster://), unix:///path/redis.sock, s3://bucket/prefix, or "
        "fs:///mnt/shared (a shared filesystem); null disables it.",
        normalize=lambda v: (v or None) if isinstance(v, str) else v,
        check=lambda v: v.partition("://")[0].lower() in REMOTE_SCHEMES and "://" in v,
        allowed="a URL with scheme " + ", ".join(REMOTE_SCHEMES) + " (empty: null)",
        nullable=True,
        lmcache_names=("remote_url",),
    )
    remote_serde: str = _key(
        "naive",
        str,
        "Codec of chunks written to the disk and remote tiers: naive (the bytes as they "
        "are) or cachegen (lossy quantization + rANS, ~4x smaller than bf16, bounded "
        "error; docs/compression.md). Each object names its codec, so readers decode "
        "whatever was written.",
        choices=("naive", "cachegen"),
        lmcache_names=("remote_serde",),
    )
    cachegen_k_levels: str = _key(
        "",
        str,
        "cachegen: quantization levels of the keys per layer (n: codes -n..n, error at "
        "most absmax/(2n) per element): one integer for every layer, or one per layer, "
        "comma-separated; empty derives them from the layer count (16 for the first "
        "third of the layers, 8 after).",
        normalize=_levels_text,
        check=_valid_levels_text,
        allowed=_LEVELS_ALLOWED,
    )
    cachegen_v_levels: str = _key(
        "",
        str,
        "cachegen: quantization levels of the values per layer, as cachegen_k_levels; "
        "empty derives them from the layer count (16 for the first sixth of the layers, "
        "8 after).",
        normalize=_levels_text,
        check=_valid_levels_text,
        allowed=_LEVELS_ALLOWED,
    )
    cachegen_device: str = _key(
        "auto",
        str,
        "cachegen: where chunks are encoded and decoded: auto (the GPU when torch sees "
        "one and triton is installed: the Triton rANS coder, same bytes as the CPU), "
        "cpu (the reference codec), or cuda.",
        choices=("auto", "cpu", "cuda"),
    )
    remote_timeout_ms: int = _key(
        1000,
        int,
        "Remote tier: the longest a lookup or a chunk get waits; slower is a miss and "
        "marks the remote down until it answers again.",
        check=lambda v: 1 <= v <= 600_000,
        allowed="an integer from 1 to 600000 (milliseconds)",
    )
    remote_reconnect_max_ms: int = _key(
        5000,
        int,
        "Remote tier: the longest pause between reconnect attempts while it is down "
        "(attempts start 100 ms apart and back off by doubling).",
        check=lambda v: 100 <= v <= 3_600_000,
        allowed="an integer from 100 to 3600000 (milliseconds)",
    )
    remote_max_concurrency: int = _key(
        16,
        int,
        "Remote tier: parallel requests (Redis connection pool size, S3 request threads).",
        check=lambda v: 1 <= v <= 1024,
        allowed="an integer from 1 to 1024",
    )
    remote_username: str | None = _key(
        None,
        str,
        "Redis/Valkey ACL user name (overrides one in remote_url).",
        nullable=True,
    )
    remote_password: str | None = _key(
        None,
        str,
        "Redis/Valkey password (overrides one in remote_url); never printed.",
        nullable=True,
        secret=True,
    )
    remote_ttl_secs: float | None = _key(
        None,
        float,
        "Redis/Valkey: expire stored chunks after this many seconds; null keeps them "
        "until the server evicts them.",
        check=lambda v: math.isfinite(v) and v > 0,
        allowed="a finite number > 0",
        nullable=True,
    )
    remote_tls_ca_file: str | None = _key(
        None, str, "rediss://: CA bundle that verifies the server.", nullable=True
    )
    remote_tls_cert_file: str | None = _key(
        None, str, "rediss://: client certificate (mutual TLS).", nullable=True
    )
    remote_tls_key_file: str | None = _key(
        None, str, "rediss://: client private key (mutual TLS).", nullable=True
    )
    s3_endpoint_url: str | None = _key(
        None,
        str,
        "s3://: endpoint of an S3-compatible store (MinIO, Ceph, ...); null is AWS.",
        nullable=True,
    )
    s3_region: str | None = _key(None, str, "s3://: region name.", nullable=True)
    s3_access_key_id: str | None = _key(
        None, str, "s3://: access key; null uses boto3's credential chain.", nullable=True
    )
    s3_secret_access_key: str | None = _key(
        None, str, "s3://: secret key; never printed.", nullable=True, secret=True
    )

    # Not keys: what load_config saw. ``sources`` maps a key to where its value came from.
    ignored_lmcache_keys: tuple[str, ...] = field(default=(), compare=False)
    sources: dict[str, str] = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        problems: list[str] = []
        for spec in CONFIG_KEYS.values():
            raw = getattr(self, spec.name)
            value = _coerce(spec, raw, origin="KVTierConfig(...)", problems=problems)
            if value is not raw:
                object.__setattr__(self, spec.name, value)
        object.__setattr__(self, "ignored_lmcache_keys", tuple(self.ignored_lmcache_keys))
        if self.local_disk and self.max_local_disk_size == 0:
            problems.append(
                f"max_local_disk_size: 0 is not allowed while local_disk is set "
                f"({self.local_disk!r}); give the disk tier's size in GB"
            )
        if problems:
            raise ConfigError(problems)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVTierConfig:
        """Validate ``data`` (kvtier or LMCache key names) over the defaults.

        Same rules as ``load_config(overrides=data, env={})``: no environment variables
        are read, but ``data["config_file"]`` is honoured. Raises ConfigError.
        """
        return load_config(overrides=data, env={})

    @property
    def max_local_cpu_bytes(self) -> int:
        """``max_local_cpu_size`` in bytes (GB = 2**30 bytes)."""
        return round(self.max_local_cpu_size * GiB)

    def to_dict(self) -> dict[str, Any]:
        """Every key and its value as a plain JSON-able dict.

        ``load_config(overrides=cfg.to_dict(), env={}) == cfg`` holds.
        """
        return {name: getattr(self, name) for name in CONFIG_KEYS}

    def source_of(self, key: str) -> str:
        """Where ``key``'s value came from: ``default``, ``override``, ``env var KVTIER_X``,
        ``file PATH`` (with ``(as lmcache_name)`` when set under an LMCache alias), or
        ``argument`` for a value given to the constructor. Raises KeyError for unknown keys.
        """
        spec = CONFIG_KEYS[key]
        if key in self.sources:
            return self.sources[key]
        return "default" if getattr(self, key) == spec.default else "argument"

    def describe(self) -> str:
        """A table of every key, its value and its source, for ``kvtier info``."""
        rows = [(name, self._shown(name), self.source_of(name)) for name in CONFIG_KEYS]
        key_width = max(len("key"), *(len(r[0]) for r in rows))
        value_width = max(len("value"), *(len(r[1]) for r in rows))
        lines = [f"{'key':<{key_width}}  {'value':<{value_width}}  source"]
        lines += [f"{k:<{key_width}}  {v:<{value_width}}  {s}" for k, v, s in rows]
        if self.ignored_lmcache_keys:
            lines.append("ignored LMCache keys: " + ", ".join(self.ignored_lmcache_keys))
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: the keys that differ from their defaults (``key=value``), or
        ``defaults``. Secrets are masked."""
        changed = [
            f"{name}={self._shown(name)}"
            for name, spec in CONFIG_KEYS.items()
            if getattr(self, name) != spec.default
        ]
        return ", ".join(changed) if changed else "defaults"

    def _shown(self, name: str) -> str:
        """The value for display: secrets (passwords, secret keys) are masked."""
        value = getattr(self, name)
        if CONFIG_KEYS[name].secret and value is not None:
            return "'***'"
        if name == "remote_url" and value is not None:
            return repr(redact_url(value))
        return repr(value)

    @property
    def max_local_disk_bytes(self) -> int:
        """``max_local_disk_size`` in bytes (GB = 2**30 bytes)."""
        return round(self.max_local_disk_size * GiB)


def redact_url(url: str) -> str:
    """``url`` with the password in its user-info replaced by ``***`` (logs, tables)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = rest.find("/")
    authority, tail = (rest, "") if end < 0 else (rest[:end], rest[end:])
    userinfo, at, hosts = authority.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.partition(':')[0]}:***@{hosts}{tail}"


# The key registry, in field order: key name -> KeySpec.
CONFIG_KEYS: dict[str, KeySpec] = {
    f.name: dataclasses.replace(f.metadata[_SPEC], name=f.name)
    for f in dataclasses.fields(KVTierConfig)
    if _SPEC in f.metadata
}

# LMCache names that differ from the kvtier key they set: LMCache name -> kvtier key.
LMCACHE_ALIASES: dict[str, str] = {
    lmcache_name: spec.name
    for spec in CONFIG_KEYS.values()
    for lmcache_name in spec.lmcache_names
    if lmcache_name != spec.name
}

_ENV_VARS: dict[str, str] = {spec.env_var: spec.name for spec in CONFIG_KEYS.values()}


def _all_known_names() -> list[str]:
    """Every key name any input may use; the candidates for "did you mean" suggestions."""
    return sorted(
        {CONFIG_FILE_KEY, *CONFIG_KEYS, *LMCACHE_ALIASES, *LMCACHE_NO_EFFECT_KEYS}
        | {*LMCACHE_UNSUPPORTED_KEYS, *LMCACHE_PLANNED_KEYS}
    )


# --------------------------------------------------------------------------------------
# Value parsing and validation
# --------------------------------------------------------------------------------------


def _coerce(
    spec: KeySpec, raw: Any, *, origin: str, problems: list[str], from_env: bool = False
) -> Any:
    """Return ``raw`` validated and normalized for ``spec``, or None after adding a problem.

    Strict for YAML/override values (a bool is not an int, "256" is not an int, an int is
    a float); ``from_env`` parses strings to the key's type first. An empty environment
    string means null for a nullable key.
    """

    def reject(detail: str = "") -> None:
        shown = "'***'" if spec.secret else repr(raw)
        if spec.name == "remote_url" and isinstance(raw, str):
            shown = repr(redact_url(raw))
        where = f"{spec.name}: {shown} from {origin} is not allowed; "
        problems.append(where + f"expected {spec.describe_allowed()}{detail}")

    value = raw
    if from_env and isinstance(raw, str):
        if raw == "" and spec.nullable:
            return None
        if spec.kind is not str:
            value = _parse_env_text(spec.kind, raw)
            if value is None:
                spellings = " (true/false, 1/0, yes/no, on/off)" if spec.kind is bool else ""
                reject(spellings)
                return None
    if value is None:
        if not spec.nullable:
            reject(" (got null)")
        return None
    if spec.normalize is not None:
        value = spec.normalize(value)
        if value is None and spec.nullable:
            return None

    if spec.kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, spec.kind) or (spec.kind is not bool and isinstance(value, bool)):
        reject(f" (got {type(value).__name__})")
        return None
    if spec.choices:
        canonical = {c.lower(): c for c in spec.choices}.get(value.strip().lower())
        if canonical is None:
            reject()
            return None
        value = canonical
    if spec.check is not None and not spec.check(value):
        reject()
        return None
    return value


def _parse_env_text(kind: type, text: str) -> Any:
    """Parse an environment string to ``kind`` (bool, int, float); None when it does not."""
    text = text.strip()
    if kind is bool:
        lowered = text.lower()
        return True if lowered in _ENV_TRUE else False if lowered in _ENV_FALSE else None
    try:
        return kind(text)
    except ValueError:
        return None


def _is_switched_off(value: Any, lmcache_default: Any) -> bool:
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


def _yaml_literal(value: Any) -> str:
    """``value`` spelled as in YAML for messages and docs: null, true, 'LRU', 256."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


def _suggest(name: str, candidates: Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


# --------------------------------------------------------------------------------------
# Reading the sources
# --------------------------------------------------------------------------------------

# One source's settings: kvtier key -> (validated value, source label).
_Settings = dict[str, tuple[Any, str]]


def _is_lmcache_feature_key(name: str) -> bool:
    return (
        name in LMCACHE_UNSUPPORTED_KEYS
        or name in LMCACHE_PLANNED_KEYS
        or name.startswith(tuple(LMCACHE_UNSUPPORTED_PREFIXES))
    )


def _check_lmcache_feature_key(name: str, raw: Any, origin: str) -> str | None:
    """The problem with an unsupported/planned LMCache key's value, or None if it is off."""
    if name in LMCACHE_PLANNED_KEYS:
        (feature, default), verdict = LMCACHE_PLANNED_KEYS[name], "not supported yet"
    elif name in LMCACHE_UNSUPPORTED_KEYS:
        (feature, default), verdict = LMCACHE_UNSUPPORTED_KEYS[name], "not supported"
    else:
        prefix = next(p for p in LMCACHE_UNSUPPORTED_PREFIXES if name.startswith(p))
        feature, default, verdict = LMCACHE_UNSUPPORTED_PREFIXES[prefix], None, "not supported"
    if _is_switched_off(raw, default):
        return None
    fix = "remove it" if default is None else f"remove it or set it to {_yaml_literal(default)}"
    return (
        f"LMCache key {name!r} is {verdict} by kvtier ({feature}): got {raw!r} from {origin}; {fix}"
    )


def _read_mapping(
    data: Mapping[Any, Any], origin: str, problems: list[str], ignored: set[str]
) -> _Settings:
    """Validate one mapping (overrides or a YAML file) of kvtier and LMCache keys."""
    settings: _Settings = {}
    given_as: dict[str, str] = {}  # kvtier key -> the name it was given under
    for name, raw in data.items():
        if not isinstance(name, str):
            problems.append(f"key {name!r} in {origin} is not a string")
            continue
        key = name if name in CONFIG_KEYS else LMCACHE_ALIASES.get(name)
        if key is not None:
            if key in given_as:
                problems.append(f"{origin} sets {key} twice, as {given_as[key]!r} and as {name!r}")
                continue
            given_as[key] = name
            label = origin if name == key else f"{origin} (as {name})"
            value = _coerce(CONFIG_KEYS[key], raw, origin=label, problems=problems)
            settings[key] = (value, label)
        elif name in LMCACHE_NO_EFFECT_KEYS:
            ignored.add(name)
        elif _is_lmcache_feature_key(name):
            if problem := _check_lmcache_feature_key(name, raw, origin):
                problems.append(problem)
        elif name == CONFIG_FILE_KEY:
            problems.append(f"{CONFIG_FILE_KEY!r} cannot be set inside {origin}")
        else:
            problems.append(f"unknown key {name!r} in {origin}{_suggest(name, _all_known_names())}")
    return settings


def _read_env(env: Mapping[str, str], problems: list[str]) -> _Settings:
    """Validate the ``KVTIER_*`` variables of ``env``."""
    settings: _Settings = {}
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in RESERVED_ENV_VARS:
            continue
        key = _ENV_VARS.get(var)
        if key is None:
            candidates = [*_ENV_VARS, *RESERVED_ENV_VARS]
            problems.append(f"unknown environment variable {var}{_suggest(var, candidates)}")
            continue
        label = f"env var {var}"
        value = _coerce(CONFIG_KEYS[key], env[var], origin=label, problems=problems, from_env=True)
        settings[key] = (value, label)
    return settings


def _read_yaml_file(path: str, problems: list[str]) -> Mapping[Any, Any]:
    """The top-level mapping of YAML file ``path``; empty after adding a problem."""
    try:
        with open(path, encoding="utf-8") as stream:
            data = yaml.safe_load(stream)
    except FileNotFoundError:
        problems.append(f"config file {path} does not exist")
        return {}
    except OSError as err:
        problems.append(f"config file {path} cannot be read: {err.strerror or err}")
        return {}
    except yaml.YAMLError as err:
        problems.append(f"config file {path} is not valid YAML: {err}")
        return {}
    if data is None:  # an empty file
        return {}
    if not isinstance(data, Mapping):
        problems.append(
            f"config file {path} must hold a mapping of keys to values at the top level, "
            f"not a {type(data).__name__}"
        )
        return {}
    return data


def _resolve_config_file(
    config_file: str | os.PathLike[str] | None,
    from_overrides: Any,
    env: Mapping[str, str],
    problems: list[str],
) -> str | None:
    if config_file is not None:
        return os.fspath(config_file)
    if from_overrides is not None:
        if isinstance(from_overrides, str | os.PathLike):
            return os.fspath(from_overrides)
        problems.append(
            f"{CONFIG_FILE_KEY}: {from_overrides!r} from override is not allowed; "
            "expected a file path"
        )
        return None
    return env.get(CONFIG_FILE_ENV_VAR) or None


def load_config(
    overrides: Mapping[str, Any] | None = None,
    config_file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> KVTierConfig:
    """Build the validated config from overrides, ``KVTIER_*`` env vars, a YAML file, defaults.

    Args:
        overrides: highest-precedence values, kvtier or LMCache key names (vLLM's
            ``kv_connector_extra_config``). May hold ``config_file``.
        config_file: YAML file to read; beats ``overrides["config_file"]`` and
            ``$KVTIER_CONFIG_FILE``. An LMCache YAML config is accepted.
        env: environment to read ``KVTIER_*`` variables from; defaults to ``os.environ``.

    Returns:
        The config; ``cfg.sources`` records where each value came from.

    Raises:
        ConfigError: listing every problem found in any source (unknown keys with a
            suggestion, wrong types, values out of range, enabled unsupported LMCache
            features, unreadable files), not just the first.
    """
    env = os.environ if env is None else env
    problems: list[str] = []
    ignored: set[str] = set()

    override_data = dict(overrides or {})
    file_in_overrides = override_data.pop(CONFIG_FILE_KEY, None)
    path = _resolve_config_file(config_file, file_in_overrides, env, problems)

    # Lowest precedence first; a later source replaces an earlier one's value.
    layers: list[_Settings] = []
    if path is not None:
        file_data = _read_yaml_file(path, problems)
        layers.append(_read_mapping(file_data, f"file {path}", problems, ignored))
    layers.append(_read_env(env, problems))
    layers.append(_read_mapping(override_data, "override", problems, ignored))
    if problems:
        raise ConfigError(problems)

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, spec in CONFIG_KEYS.items():
        values[name], sources[name] = spec.default, "default"
        for layer in layers:
            if name in layer:
                values[name], sources[name] = layer[name]

    if ignored:
        logger.warning(
            "ignoring LMCache config keys that have no effect in kvtier: %s",
            ", ".join(sorted(ignored)),
        )
    config = KVTierConfig(**values, ignored_lmcache_keys=tuple(sorted(ignored)))
    object.__setattr__(config, "sources", sources)
    return config


# --------------------------------------------------------------------------------------
# Reference documentation, generated from the tables above
# --------------------------------------------------------------------------------------


def _markdown_value(value: Any) -> str:
    return f"`{_yaml_literal(value)}`"


def config_reference_markdown() -> str:
    """The key table of docs/configuration.md, generated from ``CONFIG_KEYS``."""
    lines = [
        "| Key | Env var | Type | Default | Allowed | LMCache name | Meaning |",
        "|---|---|---|---|---|---|---|",
    ]
    for spec in CONFIG_KEYS.values():
        type_name = spec.kind.__name__ + (" \\| None" if spec.nullable else "")
        lmcache = ", ".join(f"`{n}`" for n in spec.lmcache_names) or "—"
        lines.append(
            f"| `{spec.name}` | `{spec.env_var}` | {type_name} | {_markdown_value(spec.default)} "
            f"| {spec.describe_allowed()} | {lmcache} | {spec.help} |"
        )
    return "\n".join(lines) + "\n"


def lmcache_reference_markdown() -> str:
    """The LMCache key lists of docs/configuration.md, generated from the tables above."""

    def names(keys: Iterable[str]) -> str:
        return ", ".join(f"`{k}`" for k in sorted(keys))

    def by_feature(table: Mapping[str, tuple[str, Any]], prefixes: Mapping[str, str]) -> list[str]:
        features: dict[str, list[str]] = {}
        for key, (feature, default) in table.items():
            text = f"`{key}`" + (
                "" if default is None else f" (default {_markdown_value(default)})"
            )
            features.setdefault(feature, []).append(text)
        for prefix, feature in prefixes.items():
            features.setdefault(feature, []).append(f"any other `{prefix}*` key")
        return [f"- {feature}: " + ", ".join(keys) for feature, keys in features.items()]

    same = [n for spec in CONFIG_KEYS.values() for n in spec.lmcache_names if n == spec.name]
    lines = [
        "**Same meaning, same name:** " + names(same),
        "",
        "**Same meaning, other name:** "
        + ", ".join(f"`{alias}` → `{key}`" for alias, key in sorted(LMCACHE_ALIASES.items())),
        "",
        "**Ignored (no effect in kvtier; one warning lists them):** "
        + names(LMCACHE_NO_EFFECT_KEYS),
        "",
        "**Unsupported features** (accepted only while off: null, false, 0, an empty "
        "string/list/mapping, or LMCache's default for the key; an error otherwise):",
        "",
        *by_feature(LMCACHE_UNSUPPORTED_KEYS, LMCACHE_UNSUPPORTED_PREFIXES),
    ]
    if LMCACHE_PLANNED_KEYS:
        lines += [
            "",
            "**Not supported yet** (same rule; later kvtier versions add them as real keys):",
            "",
            *by_feature(LMCACHE_PLANNED_KEYS, {}),
        ]
    return "\n".join(lines) + "\n"
