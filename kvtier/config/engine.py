"""The keys of the cache engine that every integration runs: the chunks, how they are
hashed and named in storage, the kernels that move them, their buffers and checksums,
and the metrics endpoint."""

from __future__ import annotations

from typing import Any

from kvtier.config.keys import KeySpec


def int_to_str(value: Any) -> Any:
    """An int as a string (keys whose strings YAML may give as numbers)."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


# The unit of hashing, storage and transfer.
CHUNKS: tuple[KeySpec, ...] = (
    KeySpec(
        "chunk_size",
        int,
        256,
        "Tokens per chunk: the unit of hashing, storage and transfer.",
        check=lambda v: 1 <= v <= 1 << 20,
        allowed="an integer from 1 to 1048576",
        lmcache_names=("chunk_size",),
    ),
)


# How a chunk chain is hashed, and whether a partial last chunk is stored.
CHUNK_HASHES: tuple[KeySpec, ...] = (
    KeySpec(
        "hash_algorithm",
        str,
        "sha256_cbor",
        "Chunk hash: sha256_cbor (vLLM's prefix-cache hash) or xxh3_128 (fast).",
        choices=("sha256_cbor", "xxh3_128"),
    ),
    KeySpec(
        "hash_seed",
        str,
        "vllm-none-hash",
        "Seed of the root hash of every chunk chain. Integers are converted to strings. "
        "The default is vLLM's own default seed for sha256_cbor; when vLLM runs with "
        "PYTHONHASHSEED set, use that value to reproduce its prefix hashes.",
        normalize=int_to_str,
        allowed="a string (an integer is converted to a string)",
    ),
    KeySpec(
        "save_unfull_chunk",
        bool,
        False,
        "Also store the partial last chunk of a prompt.",
        lmcache_names=("save_unfull_chunk",),
    ),
)


# Which kernels move and code chunks, their tuning files and their compilation.
KERNELS: tuple[KeySpec, ...] = (
    KeySpec(
        "kernel_backend",
        str,
        "auto",
        "Kernel implementation: auto (Triton on a GPU Triton can drive, else numba where "
        "numba is installed, else torch), triton, interpret (Triton interpreter), torch "
        "(reference kernels; the numpy CacheGen coder) or numba (the CPU kernels numba "
        "compiles: the paged copies, RoPE and the CacheGen coder; for KV on the CPU).",
        choices=("auto", "triton", "interpret", "torch", "numba"),
    ),
    KeySpec(
        "tuning_dir",
        str,
        None,
        "Directory of per-device kernel tuning files (`kvtier tune --out`), searched before "
        "the built-in path (several: `os.pathsep`-separated); null: the built-in path only "
        "(`KVTIER_TUNING_DIR`, read by the kernels themselves, else "
        "`~/.cache/kvtier/tuning`, then packaged defaults). Applied process-wide by the "
        "vLLM worker (`paged_io.use_tuning_dir`), never by a `CacheEngine`.",
        check=lambda v: v != "",
        allowed="a non-empty string",
        nullable=True,
    ),
    KeySpec(
        "precompile_kernels",
        bool,
        False,
        "vLLM connector: at start-up, compile the paged-copy Triton kernels for this "
        "engine's KV cache (every token count up to chunk_size) in a background thread, so "
        "the first request does not wait for Triton's JIT; kept in Triton's cache "
        "(TRITON_CACHE_DIR). On a CPU: the numba kernels this config runs (cachegen, "
        "CacheBlend's RoPE), kept in numba's cache. Off: they compile on first use. See "
        "`kvtier precompile`.",
    ),
)


# What the storage keys of a model's chunks (or pages) are made of.
NAMING: tuple[KeySpec, ...] = (
    KeySpec(
        "model_name",
        str,
        None,
        "Model name used in storage keys; null takes it from the engine.",
        check=lambda v: v != "",
        allowed="a non-empty string",
        nullable=True,
    ),
    KeySpec(
        "key_salt",
        str,
        None,
        "SGLang backend: text added to every page's storage key, so that deployments "
        "sharing a tier (same model and ranks) never read each other's pages; null: none.",
        check=lambda v: v != "",
        allowed="a non-empty string",
        nullable=True,
    ),
)


# The CPU buffers of chunks, and whether their bytes are checksummed in memory too.
BUFFERS: tuple[KeySpec, ...] = (
    KeySpec(
        "pool_alignment",
        int,
        256,
        "Byte alignment of buffers in the CPU memory pool.",
        check=lambda v: is_power_of_two(v) and v <= 4096,
        allowed="a power of two from 1 to 4096",
    ),
    KeySpec(
        "verify_checksums",
        bool,
        False,
        "Also checksum chunks held in kvtier's own memory (xxh3-64 when stored, verified "
        "before every load): a paranoid mode, one more pass over the bytes per store and "
        "per load. Chunks read back from disk, a remote store, kvtier serve or shared "
        "memory are verified against their stored checksum either way; a mismatch is a "
        "miss, never wrong KV.",
    ),
)


# The Prometheus endpoint.
METRICS: tuple[KeySpec, ...] = (
    KeySpec(
        "metrics_port",
        int,
        None,
        "Serve Prometheus metrics on this port (/metrics); null: off. Inside vLLM the "
        "scheduler process serves every rank's metrics; data-parallel engine i uses "
        "metrics_port + i.",
        check=lambda v: 0 <= v <= 65535,
        allowed="a port number from 0 to 65535 (0: any free port)",
        nullable=True,
    ),
    KeySpec(
        "metrics_host",
        str,
        "127.0.0.1",
        "Address the metrics endpoint binds to (0.0.0.0 to let a remote Prometheus scrape).",
        check=lambda v: v != "",
        allowed="a host name or IP address ([::1] is ::1)",
        normalize=lambda v: v[1:-1] if isinstance(v, str) and v[:1] + v[-1:] == "[]" else v,
    ),
)
