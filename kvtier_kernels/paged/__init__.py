"""Paged gather / scatter between an engine's paged KV cache and a ``KV_2LTD`` chunk (the
``paged_gather`` and ``paged_scatter`` ops).

- :mod:`~kvtier_kernels.paged.copy`: the torch references, the Triton kernel (one kernel,
  ``TO_CHUNK`` picks the direction) and the launchers;
- :mod:`~kvtier_kernels.paged.rows`: the rows and integer words the copies move, and the
  torch backend's fast paths.
"""

from kvtier_kernels.paged.copy import gather, gather_reference, scatter, scatter_reference

__all__ = ["gather", "gather_reference", "scatter", "scatter_reference"]
