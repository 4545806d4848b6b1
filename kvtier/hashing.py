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

``chain_array`` hashes every chunk of a token sequence in one call. For ``sha256_cbor``
it reads a ``list[int]`` (what vLLM's ``Request`` holds) into a uint32 array through
``array.array``, encodes the tokens' CBOR with a few NumPy passes (each id's head byte and
big-endian value as one word, the words added into place at their byte offsets), and
feeds each chunk's slice of that stream to SHA-256: the bytes ``cbor2`` writes for a tuple
of Python ints, without a Python object per token. Ids outside ``[0, 2**32)`` take the
``cbor2`` path.
"""

from __future__ import annotations

import array
import bisect
import functools
import hashlib
import sys
import threading
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
# 1, 2, 3 or 5 bytes, the head byte (none for the smallest) placed just above the value's.
_CBOR_HEAD = np.array([0, 0x18 << 8, 0x19 << 16, 0x1A << 32], dtype=np.uint64)
_CBOR_NONE = b"\xf6"
# Tokens encoded in one pass: the bound on each thread's work arrays (about 1.2 MiB).
_PASS_TOKENS = 1 << 15


@functools.lru_cache(maxsize=64)
def _cbor_head(major: int, n: int) -> bytes:
    """A CBOR head: major type ``major`` with argument ``n`` in its shortest form."""
    if n < 24:
        return bytes([major << 5 | n])
    for code, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * width):
            return bytes([major << 5 | code]) + n.to_bytes(width, "big")
    raise ValueError(f"{n} does not fit a CBOR head")


def _as_uint32(tokens: np.ndarray) -> np.ndarray | None:
    """``tokens`` as uint32, or None when an id is outside ``[0, 2**32)``."""
    if tokens.dtype == np.uint32 or not tokens.size:
        return tokens.astype(np.uint32, copy=False)
    if int(tokens.min()) < 0 or int(tokens.max()) >= 1 << 32:
        return None
    return tokens.astype(np.uint32)


class _WorkArrays(threading.local):
    """One thread's arrays for ``_cbor_uint_stream``, reused from call to call.

    NOTE: fresh arrays of a long prompt's size cost more in page faults (the allocator
    hands large blocks back to the OS when they are freed) than the encoding itself.
    """

    capacity = 0

    def take(self, n: int) -> _WorkArrays:
        if n > self.capacity or not self.capacity:
            self.capacity = max(n, min(2 * self.capacity, _PASS_TOKENS), 256)
            c = self.capacity
            self.flag, self.size_class, self.shift = np.empty((3, c), dtype=np.uint8)
            self.word, self.part = np.empty((2, c), dtype=np.uint64)
            self.offsets = np.empty(c + 1, dtype=np.int64)
            self.slot = np.empty(c, dtype=np.intp)
            self.slots = np.empty(5 * c // 8 + 2, dtype=np.uint64)
        return self


_work = _WorkArrays()


def _cbor_uint_stream(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Canonical CBOR of each id in ``values`` (uint32), concatenated, and where each id's
    encoding starts in it (``offsets[i]``; ``offsets[-1]`` is the stream's length). Both
    are this thread's work arrays: valid until its next call. Little-endian hosts only.

    An id's encoding is the tail of an 8-byte big-endian word: the value, the CBOR head
    just above it, zero bytes above that. Each word is added into the output so that it
    ends where the id's encoding must end, split over the two aligned 8-byte slots it
    straddles (one ``np.add.at`` per half). A word's zero bytes fall on the bytes of the
    ids before it, so no addition carries: adding writes each byte exactly once.
    """
    n = values.size
    work = _work.take(n)
    flag, size_class = work.flag[:n], work.size_class[:n]
    np.greater_equal(values, 24, out=size_class.view(bool))
    for bound in (256, 65536):
        np.greater_equal(values, bound, out=flag.view(bool))
        size_class += flag
    flag += size_class  # flag (value >= 65536) + size class + 1: 1, 2, 3 or 5 bytes
    flag += 1
    offsets = work.offsets[: n + 1]
    offsets[0] = 0
    np.cumsum(flag, out=offsets[1:])
    word = np.take(_CBOR_HEAD, size_class, out=work.word[:n], mode="clip")
    word |= values
    word.byteswap(inplace=True)  # little-endian: the encoding in the word's last bytes
    # word i lands at byte offsets[i + 1] of a buffer that starts with 8 bytes of room
    shift = np.bitwise_and(offsets[1:], 7, out=work.shift[:n], casting="unsafe")
    shift <<= 3
    slot = np.right_shift(offsets[1:], 3, out=work.slot[:n])
    total = int(offsets[n])
    slots = work.slots[: total // 8 + 2]
    slots.fill(0)
    np.add.at(slots, slot, np.left_shift(word, shift, out=work.part[:n]))
    slot += 1
    word >>= 1
    shift ^= 63
    word >>= shift  # with the shift by 1: word >> (64 - 8 * (offset % 8)), 0 when aligned
    np.add.at(slots, slot, word)
    return slots.view(np.uint8)[8 : 8 + total], offsets


def _sha256_cbor_chain(
    values: np.ndarray,
    bounds: Sequence[tuple[int, int]],
    extras: Sequence[ExtraKeys] | None,
    parent: bytes,
) -> list[bytes]:
    """``sha256_cbor((parent, tuple(chunk), extra))`` chained over ``bounds``: the bytes
    ``cbor2.dumps(..., canonical=True)`` writes, built from vectorised encodings of
    ``values`` (uint32 ids), a pass of whole chunks at a time."""
    ends = [end for _, end in bounds]
    out: list[bytes] = []
    h, i = parent, 0
    while i < len(bounds):
        first = bounds[i][0]
        j = max(bisect.bisect_right(ends, first + _PASS_TOKENS, i), i + 1)
        stream, offsets = _cbor_uint_stream(values[first : ends[j - 1]])
        chunks = bounds[i:j]
        edges = offsets.take([p - first for bound in chunks for p in bound]).tolist()
        body = memoryview(stream)
        chunk_extras = [None] * len(chunks) if extras is None else extras[i:j]
        for (start, end), extra, a, b in zip(
            chunks, chunk_extras, edges[::2], edges[1::2], strict=True
        ):
            digest = hashlib.sha256(
                b"\x83" + _cbor_head(2, len(h)) + h + _cbor_head(4, end - start)
            )
            digest.update(body[a:b])
            digest.update(_CBOR_NONE if extra is None else cbor2.dumps(extra, canonical=True))
            h = digest.digest()
            out.append(h)
        i = j
    return out


def token_array(tokens: TokenIds) -> np.ndarray:
    """``tokens`` as a one-dimensional integer array (an array or a CPU tensor's numpy
    view as it is, without a copy).

    A Python sequence of ids in ``[0, 2**32)``, such as the ``list[int]`` vLLM's
    ``Request`` holds, is read through ``array.array("I")`` into uint32, several times
    faster than NumPy's conversion of a list; other ids (negative, or 2**32 and up) go
    through NumPy.

    Raises:
        ValueError: tokens that are not one-dimensional or not integers.
    """
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    elif not isinstance(tokens, np.ndarray | str | bytes | bytearray | memoryview):
        try:
            return np.frombuffer(array.array("I", tokens), dtype=np.uint32)
        except (TypeError, OverflowError):
            pass  # ids outside [0, 2**32), or not integers: NumPy tells which
    values = np.asarray(tokens)
    if values.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {tuple(values.shape)}")
    if values.size and not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {values.dtype}")
    return values if values.size else values.astype(np.int64)


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
        tokens: TokenIds,
        bounds: Sequence[tuple[int, int]],
        extras: Sequence[ExtraKeys] | None = None,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """``chain`` over the chunks ``tokens[start:end]`` for each ``(start, end)`` in
        ``bounds`` (consecutive), the same hashes from one vectorised pass.

        Args:
            tokens: one-dimensional token ids (see ``token_array``).
            bounds: ``[start, end)`` of each chunk, in prompt order.
            extras: per-chunk extra keys (same length as ``bounds``) or None.
            parent: hash to chain the first chunk on (default: the root).
        """
        if extras is not None and len(extras) != len(bounds):
            raise ValueError(f"got {len(extras)} extra keys for {len(bounds)} chunks")
        tokens = token_array(tokens)
        h = self.root() if parent is None else parent
        if self.algorithm == "xxh3_128":
            return self.chain([tokens[s:e] for s, e in bounds], extras, h)
        vectorised = isinstance(h, bytes) and sys.byteorder == "little"
        values = _as_uint32(tokens) if vectorised else None
        if values is not None:
            return _sha256_cbor_chain(values, bounds, extras, h)
        as_list = tokens.tolist()  # CBOR hashes Python ints; convert once
        return self.chain([as_list[s:e] for s, e in bounds], extras, h)
