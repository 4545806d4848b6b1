"""CacheGen's entropy coder: lane-parallel rANS as two ops, ``rans_encode`` and
``rans_decode``, each with a numpy reference, a Triton kernel and a numba kernel.

- :mod:`~kvtier_kernels.cachegen.rans.common`: the bitstream, its constants,
  :class:`CodecError`, the table checks and launch parameters both ops share;
- :mod:`~kvtier_kernels.cachegen.rans.encode` / :mod:`~kvtier_kernels.cachegen.rans.decode`:
  one op each (references, numba kernel, launchers, registration);
- :mod:`~kvtier_kernels.cachegen.rans.kernels`: the Triton kernels of both ops, and
  :mod:`~kvtier_kernels.cachegen.rans.plans`: their cached launch plans.
"""

from kvtier_kernels.cachegen.rans.common import PROB_BITS, PROB_SCALE, CodecError
from kvtier_kernels.cachegen.rans.decode import rans_decode, rans_decode_lanes
from kvtier_kernels.cachegen.rans.encode import rans_encode, rans_encode_lanes

__all__ = [
    "PROB_BITS",
    "PROB_SCALE",
    "CodecError",
    "rans_decode",
    "rans_decode_lanes",
    "rans_encode",
    "rans_encode_lanes",
]
