"""kvtier_kernels: device ops for kvtier (Triton kernels, torch references, layouts, registry).

Importing this package registers every op's torch reference and never imports ``triton``
or ``numba`` or touches a GPU driver; Triton and numba kernels are loaded on first use
through the registry.
"""

import kvtier_kernels.rans_decode
import kvtier_kernels.rans_encode
import kvtier_kernels.rope_numba  # noqa: F401
from kvtier_kernels import registry
from kvtier_kernels.layouts import KV_2LTD, LAYOUTS, KVLayout, LayoutError, PagedKV, get_layout
from kvtier_kernels.paged_copy import gather, scatter
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
