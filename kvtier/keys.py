"""Storage keys: what names one stored chunk in every tier.

A key carries everything that must differ between two chunks that are not
interchangeable: the model, the parallel layout (world size, rank), the KV dtype, the
chained chunk hash (which already covers the prefix, LoRA, multimodal inputs and the
tenant's cache salt), for layer-wise objects the layer, and tags for what else decides
the bytes: the engines tag every chunk with its KV geometry (``geometry_tag``), so a
model of another geometry under the same name misses instead of finding chunks it cannot
load. Its canonical string form is used by every store (file names, Redis keys, S3 object
names) and round-trips exactly::

    kvtier1@<model>@<world_size>@<rank>@<kv_dtype>@<chunk_hash_hex>[@L<layer>][@<tag>=<value>...]

Fields that may contain ``@``, ``/``, ``%`` or ``=`` (the model name, tags) are
percent-encoded, so the string never contains a path separator and splits unambiguously.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from urllib.parse import quote, unquote

KEY_FORMAT = "kvtier1"
GEOMETRY_TAG = "kv_geometry"
_SEP = "@"


class KeyFormatError(ValueError):
    """A key string that does not parse."""


def _enc(text: str) -> str:
    # surrogateescape: a path Python read as bytes that are not UTF-8 (vLLM's --model from
    # argv) holds lone surrogates; its own bytes are encoded, as ``_dec`` gives them back
    return quote(text.encode("utf-8", "surrogateescape"), safe="-_.:+")


def _dec(text: str) -> str:
    return unquote(text, errors="surrogateescape")


@dataclass(frozen=True, slots=True)
class CacheKey:
    """The key of one stored chunk (or one layer of a chunk).

    Attributes:
        model_name: the model the KV was computed with.
        world_size: tensor-parallel world size of the engine that produced it.
        rank: the worker rank whose KV shard this is.
        kv_dtype: the KV cache dtype name (``bfloat16``, ``float8_e4m3fn``, …).
        chunk_hash: the chained chunk hash (bytes).
        layer: the layer id for layer-wise objects, else None.
        tags: extra (name, value) pairs that must separate caches, sorted by name.
    """

    model_name: str
    world_size: int
    rank: int
    kv_dtype: str
    chunk_hash: bytes
    layer: int | None = None
    tags: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("CacheKey.model_name must not be empty")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"CacheKey rank={self.rank} is not in [0, world_size={self.world_size})"
            )
        if self.layer is not None and self.layer < 0:
            raise ValueError(f"CacheKey.layer must be >= 0, got {self.layer}")
        if list(self.tags) != sorted(self.tags):
            object.__setattr__(self, "tags", tuple(sorted(self.tags)))

    def to_string(self) -> str:
        """The canonical string form (see the module docstring)."""
        return _canonical_string(self)

    __str__ = to_string

    @classmethod
    def from_string(cls, text: str) -> CacheKey:
        """Parse a canonical key string.

        Raises:
            KeyFormatError: when the string is not a kvtier key of a known format.
        """
        parts = text.split(_SEP)
        if len(parts) < 6 or parts[0] != KEY_FORMAT:
            raise KeyFormatError(f"not a {KEY_FORMAT} key: {text!r}")
        try:
            model, world, rank, dtype, hash_hex = parts[1:6]
            layer: int | None = None
            tags: list[tuple[str, str]] = []
            for extra in parts[6:]:
                if "=" in extra:
                    name, value = extra.split("=", 1)
                    tags.append((_dec(name), _dec(value)))
                elif extra.startswith("L") and layer is None and not tags:
                    layer = int(extra[1:])
                else:
                    raise ValueError(f"unexpected field {extra!r}")
            return cls(
                model_name=_dec(model),
                world_size=int(world),
                rank=int(rank),
                kv_dtype=_dec(dtype),
                chunk_hash=bytes.fromhex(hash_hex),
                layer=layer,
                tags=tuple(tags),
            )
        except ValueError as exc:
            raise KeyFormatError(f"malformed {KEY_FORMAT} key {text!r}: {exc}") from exc

    def with_layer(self, layer: int) -> CacheKey:
        """The layer-wise key of this chunk's layer ``layer``."""
        return replace(self, layer=layer)

    def chunk_key(self) -> CacheKey:
        """The whole-chunk key this (possibly layer-wise) key belongs to."""
        return replace(self, layer=None) if self.layer is not None else self


def geometry_tag(*dims: int) -> tuple[str, str]:
    """The key tag of a chunk's KV geometry: ``("kv_geometry", "32x8x128")`` for ``dims``
    (layers, KV heads, head size) of the KV cache a rank holds, an MLA cache having one
    latent head. Deterministic: engines of one model and parallel layout (a prefill and a
    decode instance too) give the same tag.

    NOTE: the chunk check at load refuses a chunk of another shape, but by then a lookup
    has counted it as a hit (and the scheduler has promised its tokens); with the
    geometry in the key, two models served under one name (a local path reused for
    another checkpoint) never find each other's chunks.
    """
    return GEOMETRY_TAG, "x".join(str(int(d)) for d in dims)


@functools.lru_cache(maxsize=1 << 15)  # lookups and stores name the same recent chunks again
def _canonical_string(key: CacheKey) -> str:
    parts = [
        KEY_FORMAT,
        _enc(key.model_name),
        str(key.world_size),
        str(key.rank),
        _enc(key.kv_dtype),
        key.chunk_hash.hex(),
    ]
    if key.layer is not None:
        parts.append(f"L{key.layer}")
    parts.extend(f"{_enc(k)}={_enc(v)}" for k, v in key.tags)
    return _SEP.join(parts)
