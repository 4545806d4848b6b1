"""A request's token ids -> the block hashes vLLM computes for them (as its KV events
carry them).

vLLM hashes each full block of ``block_size`` tokens, chained on the block before
(``vllm.v1.core.kv_cache_utils.hash_block_tokens``)::

    NONE_HASH = H(seed)                     seed: PYTHONHASHSEED, else "vllm-none-hash"
    h_i       = H((h_{i-1}, tuple(tokens_i), extra_i))     h_{-1} = NONE_HASH

with ``H`` its ``--prefix-caching-hash-algo``: ``sha256`` (pickle, vLLM's default),
``sha256_cbor`` (canonical CBOR; kvtier's own ``sha256_cbor``, byte-identical and
vectorised), ``xxhash`` / ``xxhash_cbor`` (XXH3-128). ``extra_i`` is None or a tuple, in
this order: ``("lora", name, path)`` on every block of a LoRA request, multimodal items
(not computed here: a request with images is scored on nothing), ``("cache_salt", salt)``
on the first block. Events publish each hash folded to 64 bits (``index.block_key``).

NOTE: with ``xxhash`` or ``xxhash_cbor`` and no PYTHONHASHSEED, every vLLM process draws a
random seed: no router can compute its hashes. The ``sha256`` algorithms default to the
fixed seed ``"vllm-none-hash"``.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cbor2
import xxhash

from kvtier.hashing import ChunkHasher
from kvtier.routing.index import block_key

VLLM_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_SEED = "vllm-none-hash"  # vLLM's NONE_HASH seed without PYTHONHASHSEED


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxhash(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _xxhash_cbor(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _sha256,
    "sha256_cbor": _sha256_cbor,
    "xxhash": _xxhash,
    "xxhash_cbor": _xxhash_cbor,
}


@dataclass(frozen=True, slots=True)
class RequestKeys:
    """What besides the tokens goes into a request's block hashes."""

    cache_salt: str | None = None
    lora: tuple[str, str] | None = None  # (adapter name, its path as the engine loaded it)

    def extras(self, num_blocks: int) -> list[tuple[Any, ...] | None] | None:
        """vLLM's per-block extra keys (``generate_block_hash_extra_keys``), or None."""
        if not self.cache_salt and self.lora is None:
            return None
        lora = [("lora", *self.lora)] if self.lora is not None else []
        out: list[tuple[Any, ...] | None] = []
        for block in range(num_blocks):
            keys = lora + (
                [("cache_salt", self.cache_salt)] if block == 0 and self.cache_salt else []
            )
            out.append(tuple(keys) if keys else None)
        return out


@dataclass(frozen=True, slots=True)
class VllmBlockHasher:
    """vLLM's block hashing with one algorithm and seed.

    Raises:
        ValueError: an algorithm vLLM does not have (the message lists them).
    """

    algo: str = "sha256_cbor"
    seed: str = DEFAULT_SEED
    _chunk_hasher: ChunkHasher = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.algo not in HASH_FUNCTIONS:
            raise ValueError(
                f"hash algorithm {self.algo!r}: allowed are {', '.join(VLLM_HASH_ALGOS)}"
            )
        object.__setattr__(self, "_chunk_hasher", ChunkHasher("sha256_cbor", self.seed))

    def none_hash(self) -> bytes:
        return HASH_FUNCTIONS[self.algo](self.seed)

    def digests(
        self,
        tokens: Sequence[int],
        block_size: int,
        extras: Sequence[tuple[Any, ...] | None] | None = None,
    ) -> list[bytes]:
        """The full hashes of every full block of ``tokens``, in order."""
        num_blocks = len(tokens) // block_size
        if num_blocks == 0:
            return []
        if extras is not None:
            extras = list(extras)[:num_blocks]
        if self.algo == "sha256_cbor":
            bounds = [(i * block_size, (i + 1) * block_size) for i in range(num_blocks)]
            return self._chunk_hasher.chain_array(tokens, bounds, extras)
        hash_fn = HASH_FUNCTIONS[self.algo]
        parent = self.none_hash()
        out = []
        for i in range(num_blocks):
            block = tuple(tokens[i * block_size : (i + 1) * block_size])
            parent = hash_fn((parent, block, None if extras is None else extras[i]))
            out.append(parent)
        return out

    def block_keys(self, tokens: Sequence[int], block_size: int, keys: RequestKeys) -> list[int]:
        """The index keys (64-bit, as events carry them) of every full block."""
        extras = keys.extras(len(tokens) // block_size)
        return [block_key(d) for d in self.digests(tokens, block_size, extras)]

    def first_block_matches(self, event_hash: int | bytes, token_ids: Sequence[int]) -> bool:
        """Whether a first block (no parent, no extra keys) an event announced has the hash
        this hasher computes: the check that the router's algorithm and seed are the
        engine's."""
        digests = self.digests(token_ids, len(token_ids))
        return bool(digests) and block_key(digests[0]) == block_key(event_hash)
