"""The shared-filesystem remote, ``remote_url: fs:///mnt/shared/kvtier``: a directory that
many machines mount (NFS, Lustre, ...), used as a file tier (``disk.FileTier``) without a
size bound or an index, since many machines write to it.
"""

from __future__ import annotations

from kvtier.config.remote_urls import parse_fs_url
from kvtier.storage.disk import FileTier
from kvtier.storage.remote import RemoteRequest


def open_remote(request: RemoteRequest) -> FileTier:
    """The shared directory of ``request.url`` as a tier (its ``RemoteOpener``, see
    ``schemes``); ``request.space`` is unused, as every key names its model."""
    return FileTier(
        parse_fs_url(request.url),
        name="fs",
        capacity_bytes=None,
        serde=request.serde,
        stats=request.stats,
        queue_capacity=request.config.store_queue_size,
        config_key="remote_url",
    )
