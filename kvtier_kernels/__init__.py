"""kvtier_kernels: device ops for kvtier (Triton kernels, torch references, layouts, registry).

Importing this package registers every op's torch reference and never imports ``triton``
or ``numba`` or touches a GPU driver; Triton and numba kernels are loaded on first use
through the registry. One subpackage per op group: :mod:`~kvtier_kernels.paged`,
:mod:`~kvtier_kernels.rope`, :mod:`~kvtier_kernels.cachegen`; launch parameters come
from :mod:`~kvtier_kernels.tuning`.
"""

import kvtier_kernels.cachegen  # noqa: F401
from kvtier_kernels import registry
from kvtier_kernels.layouts import KV_2LTD, LAYOUTS, KVLayout, LayoutError, PagedKV, get_layout
from kvtier_kernels.paged import gather, scatter
from kvtier_kernels.rope import rerotate

__all__ = [
    "KV_2LTD",
    "LAYOUTS",
    "KVLayout",
    "LayoutError",
    "PagedKV",
    "gather",
    "get_layout",
    "registry",
    "rerotate",
    "scatter",
]
