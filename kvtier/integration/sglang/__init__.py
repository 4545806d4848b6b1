"""kvtier as an SGLang HiCache storage backend (docs/sglang.md).

Enable it with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integration.sglang", "class_name": "KVTierHiCacheStorage",
        "interface_v1": 1, "local_disk": "/var/cache/kvtier", "max_local_disk_size": 100}'

``KVTierHiCacheStorage`` is imported lazily, so the SGLang-free part of this package
(``pages``: page formats and keys) imports without SGLang.
"""

from typing import Any

__all__ = ["KVTierHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "KVTierHiCacheStorage":
        from kvtier.integration.sglang import storage

        return storage.KVTierHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
