"""CacheBlend's segments: where a prompt's separator-delimited segments are, their keys,
and the segment store.

    tokens   | seg 0 |sep| seg 1 |sep| seg 2 |
    segment  [start, end) of each piece between separators; separators belong to none

A segment's key hashes its own tokens only (plus the request's extras: cache salt, LoRA),
never what precedes it, so the same document is found wherever it appears. Its stored
object is its KV as computed, ``[2, L, n, Hkv * D]`` with keys rotated for the positions
it sat at, and beside it those positions (``[n]`` int64), under the same hash with the tag
``blend=kv`` / ``blend=pos``. Both go to the ordinary tiers (CPU, disk, remote).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.chunker import RequestExtras
from kvtier.hashing import ChunkHasher
from kvtier.keys import CacheKey
from kvtier.storage.checked import CheckedChunks
from kvtier.storage.manager import StorageManager

__all__ = ["Segment", "SegmentStore", "segment_hash", "split_segments"]

_DOMAIN = "kvtier-blend-segment"  # keeps segment hashes apart from prefix-chunk hashes


@dataclass(frozen=True, slots=True)
class Segment:
    """Tokens ``[start, end)`` of a prompt, between separators."""

    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def split_segments(
    tokens: Sequence[int], separator: Sequence[int], min_tokens: int, end: int | None = None
) -> list[Segment]:
    """The pieces of ``tokens[:end]`` between occurrences of ``separator`` that have at
    least ``min_tokens`` tokens (an empty separator: the whole prompt is one piece)."""
    end = len(tokens) if end is None else end
    sep, n = list(separator), len(separator)
    bounds, start, i = [], 0, 0
    while n and i + n <= end:
        if list(tokens[i : i + n]) == sep:
            bounds.append((start, i))
            start = i = i + n
        else:
            i += 1
    bounds.append((start, end))
    return [Segment(s, e) for s, e in bounds if e - s >= min_tokens]


def segment_hash(
    hasher: ChunkHasher, tokens: Sequence[int], extras: RequestExtras | None = None
) -> bytes:
    """The key hash of a segment: its own tokens, the cache salt and LoRA, not its place."""
    extra: tuple = (_DOMAIN,)
    if extras is not None:
        extra += (extras.lora_name or "", extras.cache_salt or "")
    return hasher.hash_chunk(hasher.root(), list(tokens), extra)


class SegmentStore:
    """Segment KV in the tiers of one ``StorageManager``.

    Args:
        storage: the tiers; its config's ``verify_checksums`` also checksums segments
            held in memory (those read from a lower tier are verified by it in any case).
        key_template: a chunk key of this engine (model, ranks, dtype, tags); segment keys
            take its fields with the segment hash and a ``blend`` tag.
    """

    def __init__(self, storage: StorageManager, key_template: CacheKey):
        self.storage = storage
        self.checked = CheckedChunks(
            storage, verify=storage.config.verify_checksums, noun="blend segment", shape_in_key=True
        )
        self.template = key_template

    def _key(self, segment_hash: bytes, part: str) -> CacheKey:
        return dataclasses.replace(
            self.template, chunk_hash=segment_hash, tags=(*self.template.tags, ("blend", part))
        )

    def contains(self, segment_hash: bytes) -> bool:
        """Whether some tier holds the segment (lower-tier hits start moving to memory)."""
        keys = [self._key(segment_hash, "kv"), self._key(segment_hash, "pos")]
        return self.storage.lookup_prefix(keys, prefetch=True) == 2

    def fits(self, kv_shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        """Whether a segment's KV of ``kv_shape`` ``[2, L, n, Hkv * D]`` and its positions
        fit in the whole CPU pool together, as ``put`` holds both (one that does not is
        never stored)."""
        positions = ((kv_shape[2],), torch.int64)
        return self.storage.cpu.fit_together([(kv_shape, dtype), positions])

    def put(self, segment_hash: bytes, kv: torch.Tensor, positions: torch.Tensor) -> bool:
        """Store a segment's KV ``[2, L, n, Hkv * D]`` and its positions ``[n]``; False when
        memory ran out (nothing is stored then)."""
        objs = []
        for part, tensor in (("pos", positions.to(torch.int64)), ("kv", kv)):
            obj = self.checked.allocate(tuple(tensor.shape), tensor.dtype)
            if obj is None:
                for _, held in objs:
                    held.ref_down()
                return False
            obj.tensor.copy_(tensor)
            objs.append((part, obj))
        for part, obj in objs:
            self.checked.put(self._key(segment_hash, part), obj)
            obj.ref_down()
        return True

    def get(
        self, segment_hash: bytes, kv_shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A copy of a segment's ``(kv, positions)``, its KV of ``kv_shape``
        ``[2, L, n, Hkv * D]`` and ``dtype``; None when either is missing, of another
        shape, or changed since it was stored (that one is then removed from the tiers)."""
        keys = [self._key(segment_hash, "kv"), self._key(segment_hash, "pos")]
        shapes = [(tuple(kv_shape), dtype), ((kv_shape[2],), torch.int64)]
        found = self.checked.get_many(keys)
        try:
            if any(obj is None for obj in found):
                return None
            # NOTE: a part of another shape, or whose bytes changed after it was stored
            # (verify_checksums), is counted and removed, so that the segment is no longer
            # held: stored afresh by the next prompt that computes it, not claimed and
            # missed by every one
            accepted = [
                self.checked.accept(key, obj, *shape)
                for key, obj, shape in zip(keys, found, shapes, strict=True)
            ]
            if not all(accepted):
                return None
            kv, positions = (obj.tensor.clone() for obj in found)
            return kv, positions
        finally:
            for obj in found:
                if obj is not None:
                    obj.ref_down()
