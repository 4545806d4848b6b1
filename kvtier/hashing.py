"""Deterministic chained chunk hashes.

A prompt is split into chunks; chunk ``i`` gets the hash

    h_0 = ROOT(seed)
    h_i = H(h_{i-1}, tokens_i, extra_i)

so a chunk's hash names the whole prefix that ends with it. Nothing here depends on
Python's ``hash()``, ``PYTHONHASHSEED`` or a random seed: the same tokens give the same
hashes in every process, on every machine, after every restart.

Two algorithms:

- ``sha256_cbor``: SHA-256 over canonical CBOR of ``(parent, tuple(tokens), extra)``,
  byte-compatible with vLLM's ``sha256_cbor`` prefix-cache hashing
  (``vllm.v1.core.kv_cache_utils.hash_block_tokens``) when given the same seed and the
  same block contents; the root is ``sha256_cbor(seed)``, which is vLLM's ``NONE_HASH``
  (vLLM's default seed is ``"vllm-none-hash"``, or ``PYTHONHASHSEED`` when that is set).
- ``xxh3_128``: XXH3-128 over ``parent || int64-LE tokens || CBOR(extra)``; several times
  faster, 128-bit, not collision resistant against an adversary (use ``sha256_cbor`` when
  tenants do not trust each other).

``chain_array`` hashes every chunk of a token array in one call. For ``sha256_cbor`` it
encodes all the tokens' CBOR at once with NumPy (each id becomes its CBOR head byte plus
its big-endian value, the bytes CBOR's shortest form keeps are selected with one mask) and
feeds each chunk's slice to SHA-256: the same bytes ``cbor2`` writes for a tuple of Python
ints, without a Python object per token. Ids outside ``[0, 2**32)`` take the ``cbor2`` path.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cbor2
import numpy as np
import torch
import xxhash

HASH_ALGORITHMS = ("sha256_cbor", "xxh3_128")

ExtraKeys = tuple[Any, ...] | None
TokenIds = Sequence[int] | np.ndarray | torch.Tensor


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 of the canonical CBOR encoding of ``obj`` (vLLM's ``sha256_cbor``)."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _sha256_cbor_chunk(parent: bytes, tokens: TokenIds, extra: ExtraKeys) -> bytes:
    if isinstance(tokens, torch.Tensor | np.ndarray):
        tokens = tokens.tolist()
    try:
        # Python ints (what ``tolist`` gives): CBOR-encoded without a per-token step
        return sha256_cbor((parent, tuple(tokens), extra))
    except cbor2.CBOREncodeError:  # e.g. NumPy integers in a list
        return sha256_cbor((parent, tuple(int(t) for t in tokens), extra))


# CBOR's shortest unsigned-int forms, by size class (value < 24, < 2**8, < 2**16, < 2**32):
# the head byte placed just above the value's bytes, and which of the big-endian uint64's
# 8 bytes the encoding keeps (its last 1, 2, 3 or 5).
_CBOR_HEAD = np.array([0, 0x18 << 8, 0x19 << 16, 0x1A << 32], dtype=np.uint64)
_CBOR_LEN = np.array([1, 2, 3, 5], dtype=np.int64)
_CBOR_KEEP = np.zeros((4, 8), dtype=bool)
for _cls, _len in enumerate(_CBOR_LEN):
    _CBOR_KEEP[_cls, 8 - _len :] = True
_CBOR_KEEP_WORD = _CBOR_KEEP.view(np.uint64).ravel()
_CBOR_NONE = b"\xf6"


@functools.lru_cache(maxsize=64)
def _cbor_head(major: int, n: int) -> bytes:
    """A CBOR head: major type ``major`` with argument ``n`` in its shortest form."""
    if n < 24:
        return bytes([major << 5 | n])
    for code, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * width):
            return bytes([major << 5 | code]) + n.to_bytes(width, "big")
    raise ValueError(f"{n} does not fit a CBOR head")


def _cbor_uint_stream(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Canonical CBOR of each id in ``tokens``, concatenated, and the end offset of each
    id's encoding in it; None when an id is outside ``[0, 2**32)`` (negative ids wrap to
    large ones here)."""
    value = tokens.astype(np.uint64)
    if value.size and int(value.max()) >= 1 << 32:
        return None
    size_class = (value >= 24).view(np.uint8) + (value >= 256).view(np.uint8)
    size_class += (value >= 65536).view(np.uint8)
    word = (value | _CBOR_HEAD[size_class]).astype(">u8").view(np.uint8)
    keep = _CBOR_KEEP_WORD[size_class].view(bool)
    return word.take(np.flatnonzero(keep)), np.cumsum(_CBOR_LEN[size_class])


def _sha256_cbor_chain(
    tokens: np.ndarray,
    bounds: Sequence[tuple[int, int]],
    extras: Sequence[ExtraKeys] | None,
    parent: bytes,
) -> list[bytes] | None:
    """``sha256_cbor((parent, tuple(chunk), extra))`` chained over ``bounds``: the bytes
    ``cbor2.dumps(..., canonical=True)`` writes, built from one vectorised encoding.
    None when an id is outside ``[0, 2**32)``."""
    encoded = _cbor_uint_stream(tokens)
    if encoded is None:
        return None
    stream, token_ends = encoded
    # byte offset where each chunk ends (only these are needed, not every token's)
    chunk_ends = token_ends[[end - 1 for _, end in bounds]].tolist() if bounds else []
    body = memoryview(stream)
    out: list[bytes] = []
    h, first = parent, 0
    for i, (start, end) in enumerate(bounds):
        extra = None if extras is None else extras[i]
        digest = hashlib.sha256(b"\x83" + _cbor_head(2, len(h)) + h + _cbor_head(4, end - start))
        digest.update(body[first : chunk_ends[i]])
        digest.update(_CBOR_NONE if extra is None else cbor2.dumps(extra, canonical=True))
        h, first = digest.digest(), chunk_ends[i]
        out.append(h)
    return out


def _tokens_as_le_int64(tokens: TokenIds) -> bytes:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    return np.ascontiguousarray(tokens, dtype="<i8").tobytes()


@dataclass(frozen=True, slots=True)
class ChunkHasher:
    """Computes chained chunk hashes with one algorithm and seed.

    Args:
        algorithm: ``"sha256_cbor"`` or ``"xxh3_128"``.
        seed: the string the root hash is derived from.

    Raises:
        ValueError: on an unknown algorithm (the message lists the known ones).
    """

    algorithm: str = "sha256_cbor"
    seed: str = "vllm-none-hash"

    def __post_init__(self) -> None:
        if self.algorithm not in HASH_ALGORITHMS:
            raise ValueError(
                f"hash_algorithm={self.algorithm!r} is not supported; "
                f"choose one of {', '.join(HASH_ALGORITHMS)}"
            )

    @property
    def digest_size(self) -> int:
        return 32 if self.algorithm == "sha256_cbor" else 16

    def root(self) -> bytes:
        """``h_0``: the parent hash of the first chunk."""
        if self.algorithm == "sha256_cbor":
            return sha256_cbor(self.seed)
        return xxhash.xxh3_128_digest(b"kvtier-root\x00" + self.seed.encode())

    def hash_chunk(self, parent: bytes, tokens: TokenIds, extra: ExtraKeys = None) -> bytes:
        """``h_i = H(parent, tokens, extra)`` for one chunk."""
        if self.algorithm == "sha256_cbor":
            return _sha256_cbor_chunk(parent, tokens, extra)
        h = xxhash.xxh3_128()
        h.update(parent)
        h.update(_tokens_as_le_int64(tokens))
        if extra is not None:
            h.update(cbor2.dumps(extra, canonical=True))
        return h.digest()

    def chain(
        self,
        chunks: Sequence[TokenIds],
        extras: Sequence[ExtraKeys] | None = None,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """Hashes of consecutive chunks, each chained on the one before.

        Args:
            chunks: token chunks in prompt order.
            extras: per-chunk extra keys (same length as ``chunks``) or None.
            parent: hash to chain the first chunk on (default: the root).
        """
        if extras is not None and len(extras) != len(chunks):
            raise ValueError(f"got {len(extras)} extra keys for {len(chunks)} chunks")
        h = self.root() if parent is None else parent
        out: list[bytes] = []
        for i, chunk in enumerate(chunks):
            h = self.hash_chunk(h, chunk, None if extras is None else extras[i])
            out.append(h)
        return out

    def chain_array(
        self,
        tokens: np.ndarray,
        bounds: Sequence[tuple[int, int]],
        extras: Sequence[ExtraKeys] | None = None,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """``chain`` over the chunks ``tokens[start:end]`` for each ``(start, end)`` in
        ``bounds`` (consecutive), the same hashes from one vectorised pass.

        Args:
            tokens: a one-dimensional integer array of token ids.
            bounds: ``[start, end)`` of each chunk, in prompt order.
            extras: per-chunk extra keys (same length as ``bounds``) or None.
            parent: hash to chain the first chunk on (default: the root).
        """
        if extras is not None and len(extras) != len(bounds):
            raise ValueError(f"got {len(extras)} extra keys for {len(bounds)} chunks")
        h = self.root() if parent is None else parent
        if self.algorithm == "sha256_cbor":
            hashes = _sha256_cbor_chain(tokens, bounds, extras, h) if isinstance(h, bytes) else None
            if hashes is not None:
                return hashes
            as_list = tokens.tolist()  # CBOR hashes Python ints; convert once
            return self.chain([as_list[s:e] for s, e in bounds], extras, h)
        return self.chain([tokens[s:e] for s, e in bounds], extras, h)
