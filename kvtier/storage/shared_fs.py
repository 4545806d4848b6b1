"""The shared-filesystem remote, ``remote_url: fs:///mnt/shared/kvtier``: a directory that
many machines mount (NFS, Lustre, ...), used as a file tier (``disk.FileTier``) without a
size bound or an index, since many machines write to it.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from kvtier.config import KVTierConfig
from kvtier.metrics import Stats
from kvtier.storage.disk import FileTier
from kvtier.storage.serde import Serde


def parse_fs_url(url: str) -> str:
    """The directory of ``fs:///path``.

    Raises:
        ValueError: naming ``remote_url``: no absolute path, or a host before it.
    """
    parts = urlsplit(url)
    if parts.netloc or not parts.path:
        raise ValueError(
            f"remote_url {url!r}: give an absolute path after fs://, e.g. fs:///mnt/shared/kvtier"
        )
    return parts.path


def open_remote(
    url: str, config: KVTierConfig, *, serde: Serde, stats: Stats, space: str
) -> FileTier:
    """The shared directory of ``url`` as a tier (a ``RemoteOpener``; ``space`` is unused:
    every key names its model)."""
    return FileTier(
        parse_fs_url(url),
        name="fs",
        capacity_bytes=None,
        serde=serde,
        stats=stats,
        queue_capacity=config.store_queue_size,
        config_key="remote_url",
    )
