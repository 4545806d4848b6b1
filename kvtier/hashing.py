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
"""

from __future__ import annotations

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
