"""CacheGen-style KV compression: per-token quantization and lane-parallel rANS.

- :mod:`~kvtier_kernels.cachegen.codec`: :func:`encode_chunk` / :func:`decode_chunk`, the
  codec over a ``KV_2LTD`` chunk (quantization, statistics, the coder, dequantization);
- :mod:`~kvtier_kernels.cachegen.tables`: the statistics models (per-lane histograms, a
  sampled Gaussian) and the choice between them;
- :mod:`~kvtier_kernels.cachegen.format`: the params and payload sections, checked;
- :mod:`~kvtier_kernels.cachegen.numba_kernels`: quantization, tables and dequantization
  as numba CPU kernels;
- :mod:`~kvtier_kernels.cachegen.rans`: the entropy coder, ops ``rans_encode`` and
  ``rans_decode``.

The bitstream is specified in docs/compression.md.
"""

from kvtier_kernels.cachegen.codec import FLOAT_DTYPES, decode_chunk, default_levels, encode_chunk
from kvtier_kernels.cachegen.format import MODELS, VERSION, params_checksum
from kvtier_kernels.cachegen.rans import CodecError
from kvtier_kernels.cachegen.tables import MAX_LEVELS, quantize_counts

__all__ = [
    "FLOAT_DTYPES",
    "MAX_LEVELS",
    "MODELS",
    "VERSION",
    "CodecError",
    "decode_chunk",
    "default_levels",
    "encode_chunk",
    "params_checksum",
    "quantize_counts",
]
