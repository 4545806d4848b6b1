"""RoPE re-rotation of cached K to new positions (the ``rope_rerotate`` op).

- :mod:`~kvtier_kernels.rope.rerotation`: the torch reference, the Triton kernel and the
  launchers (backends ``torch``, ``triton``, ``interpret``);
- :mod:`~kvtier_kernels.rope.numba_kernels`: the ``numba`` backend, bit-identical to the
  reference.
"""

# NOTE: importing the numba backend's module is what registers it
from kvtier_kernels.rope import numba_kernels  # noqa: F401
from kvtier_kernels.rope.rerotation import rerotate, rerotate_reference, rope_inv_freq

__all__ = ["rerotate", "rerotate_reference", "rope_inv_freq"]
