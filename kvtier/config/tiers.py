"""The keys of the tiers: the pinned CPU memory tier, the tiers below it (the write
queue, the local disk, the remote tier's URL) and the codec of what is written to disk
and remote tiers. How a remote is reached is ``remote``."""

from __future__ import annotations

import math
from typing import Any

from kvtier.config.keys import KeySpec, empty_as
from kvtier.config.remote import REMOTE_SCHEMES, redact_url
from kvtier.config.remote_urls import check_remote_url, is_remote_or_lmcache_url


def strip_file_scheme(path: str) -> str:
    """LMCache spells ``local_disk`` as ``file:///path``; kvtier takes either."""
    return path[len("file://") :] if path.startswith("file://") else path


def levels_text(value: Any) -> Any:
    """A levels schedule as text: YAML may give an int or a list of ints."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, list | tuple) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return ",".join(map(str, value))
    return value.replace(" ", "") if isinstance(value, str) else value


LEVELS_ALLOWED = "empty, or comma-separated integers from 1 to 127 (one, or one per layer)"


def valid_levels_text(text: str) -> bool:
    """Whether ``text`` (after ``levels_text``) is a levels schedule."""
    if not text:
        return True
    parts = text.split(",")
    return all(p.isdecimal() and 1 <= int(p) <= 127 for p in parts)


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


# The pinned CPU memory tier.
CPU_TIER: tuple[KeySpec, ...] = (
    KeySpec(
        "local_cpu",
        bool,
        True,
        "Keep chunks in the pinned CPU memory tier.",
        lmcache_names=("local_cpu",),
    ),
    KeySpec(
        "max_local_cpu_size",
        float,
        5.0,
        "Size of the pinned CPU memory pool in GB (binary: 1 GB = 2**30 bytes).",
        check=lambda v: math.isfinite(v) and v > 0,
        allowed="a finite number > 0 (GB = 2**30 bytes)",
        lmcache_names=("max_local_cpu_size", "max_local_cache_size"),
    ),
    KeySpec(
        "cache_policy",
        str,
        "LRU",
        "Eviction policy of the CPU tier (case-insensitive).",
        choices=("LRU", "LFU", "FIFO", "MRU"),
        lmcache_names=("cache_policy",),
    ),
)


# The tiers below the CPU: their write queue, the local disk tier, the remote tier.
LOWER_TIERS: tuple[KeySpec, ...] = (
    KeySpec(
        "store_queue_size",
        int,
        256,
        "Chunks waiting to be written to each tier below the CPU (disk, remote); when "
        "the queue is full a store is dropped and counted, never waited for.",
        check=lambda v: 1 <= v <= 1 << 20,
        allowed="an integer from 1 to 1048576",
    ),
    KeySpec(
        "local_disk",
        str,
        None,
        "Local disk tier: a directory (or file:// URL) for chunk files that survive "
        "restarts and are shared by the engines of this machine; null disables the tier.",
        normalize=lambda v: (strip_file_scheme(v) or None) if isinstance(v, str) else v,
        allowed="a directory path or file:// URL (empty: null)",
        nullable=True,
        lmcache_names=("local_disk",),
    ),
    KeySpec(
        "max_local_disk_size",
        float,
        20.0,
        "Size bound of the local disk tier in GB (2**30 bytes), per worker rank of a "
        "tensor- or pipeline-parallel engine; the oldest chunk files are evicted "
        "(cache_policy order) to stay under it.",
        check=lambda v: math.isfinite(v) and v >= 0,
        allowed="a finite number >= 0 (GB = 2**30 bytes; > 0 when local_disk is set)",
        lmcache_names=("max_local_disk_size",),
    ),
    KeySpec(
        "local_disk_o_direct",
        bool,
        False,
        "Local disk tier: read and write with O_DIRECT (bypass the page cache); falls "
        "back to buffered I/O with a warning where the filesystem refuses it.",
    ),
    KeySpec(
        "remote_url",
        str,
        None,
        "Remote tier shared by many engines: redis://[user:pass@]host:port/db, rediss:// "
        "(TLS), redis-cluster://host:port[,host:port], valkey:// (and valkeys://, "
        "valkey-cluster://), unix:///path/redis.sock, s3://bucket/prefix, fs:///mnt/shared "
        "(a shared filesystem) or kvtier://host:port (`kvtier serve`; also lm://); null: off.",
        normalize=empty_as(None),
        check=is_remote_or_lmcache_url,
        allowed="a URL with scheme " + ", ".join(REMOTE_SCHEMES) + " (empty: null)",
        parse=check_remote_url,
        nullable=True,
        lmcache_names=("remote_url",),
        redact=redact_url,
    ),
)


# How chunks are coded on the disk and remote tiers.
CODEC: tuple[KeySpec, ...] = (
    KeySpec(
        "remote_serde",
        str,
        "naive",
        "Codec of chunks written to the disk and remote tiers: naive (the bytes as they "
        "are) or cachegen (lossy quantization + rANS, ~4x smaller than bf16, bounded "
        "error; docs/compression.md). Each object names its codec, so readers decode "
        "whatever was written.",
        choices=("naive", "cachegen"),
        lmcache_names=("remote_serde",),
    ),
    KeySpec(
        "cachegen_k_levels",
        str,
        "",
        "cachegen: quantization levels of the keys per layer (n: codes -n..n, error at "
        "most absmax/(2n) per element): one integer for every layer, or one per layer, "
        "comma-separated; empty derives them from the layer count (16 for the first "
        "third of the layers, 8 after).",
        normalize=levels_text,
        check=valid_levels_text,
        allowed=LEVELS_ALLOWED,
    ),
    KeySpec(
        "cachegen_v_levels",
        str,
        "",
        "cachegen: quantization levels of the values per layer, as cachegen_k_levels; "
        "empty derives them from the layer count (16 for the first sixth of the layers, "
        "8 after).",
        normalize=levels_text,
        check=valid_levels_text,
        allowed=LEVELS_ALLOWED,
    ),
    KeySpec(
        "cachegen_device",
        str,
        "auto",
        "cachegen: where chunks are encoded and decoded: auto (the GPU when torch sees "
        "one and triton is installed: the Triton rANS coder, same bytes as the CPU), "
        "cpu (numba kernels where numba is installed, else the numpy reference: the same "
        "bytes), or cuda.",
        choices=("auto", "cpu", "cuda"),
    ),
)
