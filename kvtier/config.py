"""kvtier configuration: one validated, immutable config object.

Every setting kvtier has is a field of :class:`KVTierConfig`, and every field carries a
``KeySpec`` (``config_keys``: type, default, allowed values, help text, LMCache names).
The registry ``CONFIG_KEYS`` is derived from those fields, so a new key is one new field.

``load_config`` merges four sources (``config_sources``), highest precedence first::

    overrides      a mapping, e.g. vLLM's ``kv_transfer_config.kv_connector_extra_config``
    environment    ``KVTIER_<KEY>`` variables (``KVTIER_CHUNK_SIZE=512``)
    YAML file      ``config_file`` argument, else ``overrides["config_file"]``,
                   else ``$KVTIER_CONFIG_FILE``, else LMCache's ``$LMCACHE_CONFIG_FILE``
    defaults       the ``KeySpec`` defaults

NOTE: this module is the only place in kvtier that reads environment variables, and it
reads them only inside ``load_config``.

LMCache configs load too (``config_lmcache``): keys with the same meaning are accepted
under LMCache's names, operational LMCache knobs that mean nothing here are ignored with
one warning, and LMCache features kvtier does not have are accepted only while switched
off. ``config_docs`` generates the key tables of docs/configuration.md.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.config_blend import blend_problems
from kvtier.config_connector import ConnectorKeys
from kvtier.config_keys import (
    LEVELS_ALLOWED,
    ConfigError,
    KeySpec,
    coerce,
    int_to_str,
    is_power_of_two,
    key,
    key_specs,
    levels_text,
    strip_file_scheme,
    valid_levels_text,
)
from kvtier.config_lmcache import lmcache_aliases
from kvtier.config_sources import (
    CONFIG_FILE_KEY,
    Settings,
    read_env,
    read_mapping,
    read_yaml_file,
    resolve_config_file,
)
from kvtier.storage.remotes import is_remote_url, redact_url, remote_schemes
from kvtier_kernels.layouts import LAYOUTS

logger = logging.getLogger(__name__)

GiB = 1 << 30  # sizes in GB are binary gigabytes (GiB, 2**30 bytes), as in LMCache


# --------------------------------------------------------------------------------------
# The config object
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class KVTierConfig(ConnectorKeys):
    """kvtier's validated settings. Build it with :func:`load_config`.

    The vLLM connector's own keys are declared in ``config_connector.ConnectorKeys``.

    Constructing it directly (or through ``dataclasses.replace``) validates and normalizes
    every key too, raising :class:`ConfigError`; such a config has no recorded sources.
    ``ignored_lmcache_keys`` lists the no-effect LMCache keys the inputs contained.
    """

    chunk_size: int = key(
        256,
        int,
        "Tokens per chunk: the unit of hashing, storage and transfer.",
        check=lambda v: 1 <= v <= 1 << 20,
        allowed="an integer from 1 to 1048576",
        lmcache_names=("chunk_size",),
    )
    local_cpu: bool = key(
        True,
        bool,
        "Keep chunks in the pinned CPU memory tier.",
        lmcache_names=("local_cpu",),
    )
    max_local_cpu_size: float = key(
        5.0,
        float,
        "Size of the pinned CPU memory pool in GB (binary: 1 GB = 2**30 bytes).",
        check=lambda v: math.isfinite(v) and v > 0,
        allowed="a finite number > 0 (GB = 2**30 bytes)",
        lmcache_names=("max_local_cpu_size", "max_local_cache_size"),
    )
    cache_policy: str = key(
        "LRU",
        str,
        "Eviction policy of the CPU tier (case-insensitive).",
        choices=("LRU", "LFU", "FIFO", "MRU"),
        lmcache_names=("cache_policy",),
    )
    hash_algorithm: str = key(
        "sha256_cbor",
        str,
        "Chunk hash: sha256_cbor (vLLM's prefix-cache hash) or xxh3_128 (fast).",
        choices=("sha256_cbor", "xxh3_128"),
    )
    hash_seed: str = key(
        "vllm-none-hash",
        str,
        "Seed of the root hash of every chunk chain. Integers are converted to strings. "
        "The default is vLLM's own default seed for sha256_cbor; when vLLM runs with "
        "PYTHONHASHSEED set, use that value to reproduce its prefix hashes.",
        normalize=int_to_str,
        allowed="a string (an integer is converted to a string)",
    )
    save_unfull_chunk: bool = key(
        False,
        bool,
        "Also store the partial last chunk of a prompt.",
        lmcache_names=("save_unfull_chunk",),
    )
    kernel_backend: str = key(
        "auto",
        str,
        "Kernel implementation: auto (Triton on a GPU Triton can drive, else numba for the "
        "CacheGen coder where numba is installed, else torch), triton, interpret (Triton "
        "interpreter) or torch (reference kernels; the numpy CacheGen coder).",
        choices=("auto", "triton", "interpret", "torch"),
    )
    tuning_dir: str | None = key(
        None,
        str,
        "Directory of per-device kernel tuning files (`kvtier tune --out`), searched before "
        "the built-in path (several: `os.pathsep`-separated); null: the built-in path only "
        "(`KVTIER_TUNING_DIR`, read by the kernels themselves, else "
        "`~/.cache/kvtier/tuning`, then packaged defaults). Applied process-wide by the "
        "vLLM worker and the CLI (`gpu_connector.use_tuning_dir`), never by a `CacheEngine`.",
        check=lambda v: v != "",
        allowed="a non-empty string",
        nullable=True,
    )
    precompile_kernels: bool = key(
        False,
        bool,
        "vLLM connector: at start-up, compile the paged-copy Triton kernels for this "
        "engine's KV cache (every token count up to chunk_size) in a background thread, so "
        "the first request does not wait for Triton's JIT; kept in Triton's cache "
        "(TRITON_CACHE_DIR). On a CPU: the numba kernels this config runs (cachegen, "
        "CacheBlend's RoPE), kept in numba's cache. Off: they compile on first use. See "
        "`kvtier precompile`.",
    )
    model_name: str | None = key(
        None,
        str,
        "Model name used in storage keys; null takes it from the engine.",
        check=lambda v: v != "",
        allowed="a non-empty string",
        nullable=True,
    )
    key_salt: str | None = key(
        None,
        str,
        "SGLang backend: text added to every page's storage key, so that deployments "
        "sharing a tier (same model and ranks) never read each other's pages; null: none.",
        check=lambda v: v != "",
        allowed="a non-empty string",
        nullable=True,
    )
    pool_alignment: int = key(
        256,
        int,
        "Byte alignment of buffers in the CPU memory pool.",
        check=lambda v: is_power_of_two(v) and v <= 4096,
        allowed="a power of two from 1 to 4096",
    )
    verify_checksums: bool = key(
        True,
        bool,
        "Checksum every stored chunk (xxh3-64) and verify it before the chunk is loaded "
        "into the engine; a mismatch is a miss, never wrong KV.",
    )
    kv_layout: str | None = key(
        None,
        str,
        "vLLM connector: the engine's KV layout (a kvtier_kernels layout name); null "
        "detects it from vLLM's attention backend and the tensors.",
        choices=tuple(LAYOUTS),
        nullable=True,
    )
    use_layerwise: bool = key(
        False,
        bool,
        "vLLM connector: move KV one layer at a time (loads finish just before each "
        "layer's attention, saves start right after it) instead of all layers per step.",
        lmcache_names=("use_layerwise",),
    )
    metrics_port: int | None = key(
        None,
        int,
        "Serve Prometheus metrics on this port (/metrics); null: off. Inside vLLM the "
        "scheduler process serves every rank's metrics; data-parallel engine i uses "
        "metrics_port + i.",
        check=lambda v: 0 <= v <= 65535,
        allowed="a port number from 0 to 65535 (0: any free port)",
        nullable=True,
    )
    metrics_host: str = key(
        "127.0.0.1",
        str,
        "Address the metrics endpoint binds to (0.0.0.0 to let a remote Prometheus scrape).",
        check=lambda v: v != "",
        allowed="a host name or IP address",
    )
    store_queue_size: int = key(
        256,
        int,
        "Chunks waiting to be written to each tier below the CPU (disk, remote); when "
        "the queue is full a store is dropped and counted, never waited for.",
        check=lambda v: 1 <= v <= 1 << 20,
        allowed="an integer from 1 to 1048576",
    )
    local_disk: str | None = key(
        None,
        str,
        "Local disk tier: a directory (or file:// URL) for chunk files that survive "
        "restarts and are shared by the engines of this machine; null disables the tier.",
        normalize=lambda v: (strip_file_scheme(v) or None) if isinstance(v, str) else v,
        allowed="a directory path or file:// URL (empty: null)",
        nullable=True,
        lmcache_names=("local_disk",),
    )
    max_local_disk_size: float = key(
        20.0,
        float,
        "Size bound of the local disk tier in GB (2**30 bytes); the oldest chunk files "
        "are evicted (cache_policy order) to stay under it.",
        check=lambda v: math.isfinite(v) and v >= 0,
        allowed="a finite number >= 0 (GB = 2**30 bytes; > 0 when local_disk is set)",
        lmcache_names=("max_local_disk_size",),
    )
    local_disk_o_direct: bool = key(
        False,
        bool,
        "Local disk tier: read and write with O_DIRECT (bypass the page cache); falls "
        "back to buffered I/O with a warning where the filesystem refuses it.",
    )
    remote_url: str | None = key(
        None,
        str,
        "Remote tier shared by many engines: redis://[user:pass@]host:port/db, rediss:// "
        "(TLS), redis-cluster://host:port[,host:port], valkey:// (and valkeys://, "
        "valkey-cluster://), unix:///path/redis.sock, s3://bucket/prefix, fs:///mnt/shared "
        "(a shared filesystem) or kvtier://host:port (`kvtier serve`; also lm://); null: off.",
        normalize=lambda v: (v or None) if isinstance(v, str) else v,
        check=is_remote_url,
        allowed="a URL with scheme " + ", ".join(remote_schemes()) + " (empty: null)",
        nullable=True,
        lmcache_names=("remote_url",),
        redact=redact_url,
    )
    remote_serde: str = key(
        "naive",
        str,
        "Codec of chunks written to the disk and remote tiers: naive (the bytes as they "
        "are) or cachegen (lossy quantization + rANS, ~4x smaller than bf16, bounded "
        "error; docs/compression.md). Each object names its codec, so readers decode "
        "whatever was written.",
        choices=("naive", "cachegen"),
        lmcache_names=("remote_serde",),
    )
    cachegen_k_levels: str = key(
        "",
        str,
        "cachegen: quantization levels of the keys per layer (n: codes -n..n, error at "
        "most absmax/(2n) per element): one integer for every layer, or one per layer, "
        "comma-separated; empty derives them from the layer count (16 for the first "
        "third of the layers, 8 after).",
        normalize=levels_text,
        check=valid_levels_text,
        allowed=LEVELS_ALLOWED,
    )
    cachegen_v_levels: str = key(
        "",
        str,
        "cachegen: quantization levels of the values per layer, as cachegen_k_levels; "
        "empty derives them from the layer count (16 for the first sixth of the layers, "
        "8 after).",
        normalize=levels_text,
        check=valid_levels_text,
        allowed=LEVELS_ALLOWED,
    )
    cachegen_device: str = key(
        "auto",
        str,
        "cachegen: where chunks are encoded and decoded: auto (the GPU when torch sees "
        "one and triton is installed: the Triton rANS coder, same bytes as the CPU), "
        "cpu (the reference codec), or cuda.",
        choices=("auto", "cpu", "cuda"),
    )
    remote_timeout_ms: int = key(
        1000,
        int,
        "Remote tier: the longest a lookup or a chunk get waits; slower is a miss and "
        "marks the remote down until it answers again.",
        check=lambda v: 1 <= v <= 600_000,
        allowed="an integer from 1 to 600000 (milliseconds)",
    )
    remote_reconnect_max_ms: int = key(
        5000,
        int,
        "Remote tier: the longest pause between reconnect attempts while it is down "
        "(attempts start 100 ms apart and back off by doubling).",
        check=lambda v: 100 <= v <= 3_600_000,
        allowed="an integer from 100 to 3600000 (milliseconds)",
    )
    remote_max_concurrency: int = key(
        16,
        int,
        "Remote tier: parallel requests (Redis connection pool size, S3 request threads).",
        check=lambda v: 1 <= v <= 1024,
        allowed="an integer from 1 to 1024",
    )
    remote_username: str | None = key(
        None,
        str,
        "Redis/Valkey ACL user name (overrides one in remote_url).",
        nullable=True,
    )
    remote_password: str | None = key(
        None,
        str,
        "Redis/Valkey password (overrides one in remote_url); never printed.",
        nullable=True,
        secret=True,
    )
    remote_ttl_secs: float | None = key(
        None,
        float,
        "Redis/Valkey: expire stored chunks after this many seconds; null keeps them "
        "until the server evicts them.",
        check=lambda v: math.isfinite(v) and v > 0,
        allowed="a finite number > 0",
        nullable=True,
    )
    remote_tls_ca_file: str | None = key(
        None, str, "rediss://: CA bundle that verifies the server.", nullable=True
    )
    remote_tls_cert_file: str | None = key(
        None, str, "rediss://: client certificate (mutual TLS).", nullable=True
    )
    remote_tls_key_file: str | None = key(
        None, str, "rediss://: client private key (mutual TLS).", nullable=True
    )
    server_token: str | None = key(
        None,
        str,
        "kvtier serve (--auth-token) and kvtier:// clients: the shared token; never shown.",
        normalize=lambda v: v or None,
        nullable=True,
        secret=True,
    )
    s3_endpoint_url: str | None = key(
        None,
        str,
        "s3://: endpoint of an S3-compatible store (MinIO, Ceph, ...); null is AWS.",
        nullable=True,
    )
    s3_region: str | None = key(None, str, "s3://: region name.", nullable=True)
    s3_access_key_id: str | None = key(
        None, str, "s3://: access key; null uses boto3's credential chain.", nullable=True
    )
    s3_secret_access_key: str | None = key(
        None, str, "s3://: secret key; never printed.", nullable=True, secret=True
    )

    # Not keys: what load_config saw. ``sources`` maps a key to where its value came from.
    ignored_lmcache_keys: tuple[str, ...] = field(default=(), compare=False)
    sources: dict[str, str] = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        problems: list[str] = []
        for spec in CONFIG_KEYS.values():
            raw = getattr(self, spec.name)
            value = coerce(spec, raw, origin="KVTierConfig(...)", problems=problems)
            if value is not raw:
                object.__setattr__(self, spec.name, value)
        object.__setattr__(self, "ignored_lmcache_keys", tuple(self.ignored_lmcache_keys))
        if self.local_disk and self.max_local_disk_size == 0:
            problems.append(
                f"max_local_disk_size: 0 is not allowed while local_disk is set "
                f"({self.local_disk!r}); give the disk tier's size in GB"
            )
        problems += blend_problems(self)
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
        ``file PATH`` or ``LMCACHE_CONFIG_FILE file PATH`` (with ``(as lmcache_name)`` when
        set under an LMCache alias), or ``argument`` for a value given to the constructor.
        Raises KeyError for unknown keys.
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
        """The value for display: secrets masked, a URL's password hidden."""
        return CONFIG_KEYS[name].shown(getattr(self, name))

    @property
    def max_local_disk_bytes(self) -> int:
        """``max_local_disk_size`` in bytes (GB = 2**30 bytes)."""
        return round(self.max_local_disk_size * GiB)


# The key registry, in field order: key name -> KeySpec.
CONFIG_KEYS: dict[str, KeySpec] = key_specs(KVTierConfig)

# LMCache names that differ from the kvtier key they set: LMCache name -> kvtier key.
LMCACHE_ALIASES: dict[str, str] = lmcache_aliases(CONFIG_KEYS)


def load_config(
    overrides: Mapping[str, Any] | None = None,
    config_file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> KVTierConfig:
    """Build the validated config from overrides, ``KVTIER_*`` env vars, a YAML file, defaults.

    Args:
        overrides: highest-precedence values, kvtier or LMCache key names (vLLM's
            ``kv_connector_extra_config``). May hold ``config_file``.
        config_file: YAML file to read; beats ``overrides["config_file"]``,
            ``$KVTIER_CONFIG_FILE`` and ``$LMCACHE_CONFIG_FILE`` (read only when none of
            kvtier's is given; one warning says so when it is ignored). An LMCache YAML
            config is accepted.
        env: environment to read ``KVTIER_*`` and ``LMCACHE_CONFIG_FILE`` from; defaults
            to ``os.environ``.

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
    file = resolve_config_file(config_file, file_in_overrides, env, problems)

    # Lowest precedence first; a later source replaces an earlier one's value.
    layers: list[Settings] = []
    if file is not None:
        file_data = read_yaml_file(file, problems)
        layers.append(read_mapping(file_data, file.origin, CONFIG_KEYS, problems, ignored))
    layers.append(read_env(env, CONFIG_KEYS, problems))
    layers.append(read_mapping(override_data, "override", CONFIG_KEYS, problems, ignored))
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
