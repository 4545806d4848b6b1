"""How long a prefix of a prompt the server holds: ``POST /lookup``, what a KV-aware
router asks before it picks an engine.

The server stores opaque blobs by name, and a kvtier client names a chunk with its key
string (``kvtier.keys``)::

    kvtier1@<model>@<world_size>@<rank>@<kv_dtype>@<chunk_hash>[@L<layer>][@<tag>=<value>...]

Every field but the chunk hash is fixed by the engine that stored it. The server learns
these *shapes* (the key with the hash taken out) from the names clients put, so a lookup
can name, for one chunk hash, every blob an engine of that shape would need:

    chunk h is held  ⇔  for some shape group (model, world size, dtype, tags, layer-wise),
                        the blobs of every rank 0..W-1 (and, layer-wise, of every layer
                        0..L-1 seen) are present

and the prefix held is the run of held chunks from the first. With a disk tier the shapes
are kept in ``<disk>/kvtier-server-v1/key-shapes.json``, so a restarted server answers
lookups for what its disk holds before any engine has talked to it.

NOTE: the number of shapes is bounded (``MAX_SHAPES_PER_NAMESPACE``, ``MAX_SHAPES`` in
all): a client cannot grow the server's memory through names or namespaces. Shapes past
a namespace's bound are not learnt; past the total, the namespaces stored into longest
ago are forgotten (their blobs stay; their chunks look absent to ``/lookup``, never
present, until an engine stores one of theirs again). The file is written at most every
``SAVE_INTERVAL_S`` (a client touching namespace after namespace would otherwise rewrite
it whole for each): a shape learnt in the last moments before a crash may be missing
after the restart, until an engine stores a blob of it again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.chunker import Chunker, MultiModalSpan, RequestExtras
from kvtier.hashing import ChunkHasher
from kvtier.keys import KEY_FORMAT, CacheKey
from kvtier.storage.remote import space_of

logger = logging.getLogger(__name__)

MAX_SHAPES_PER_NAMESPACE = 1024
MAX_SHAPES = 1 << 16  # of every namespace together
SAVE_INTERVAL_S = 1.0
MAX_LOOKUP_CHUNKS = 1 << 16  # 16M tokens at chunk_size 256
SHAPES_FILE = "key-shapes.json"
_SEP = "@"


@dataclass(frozen=True, slots=True)
class _Group:
    """Shapes whose blobs together hold one chunk: one per rank (and per layer)."""

    head: str  # "kvtier1@<model>@<world>"
    world_size: int
    dtype: str
    tail: str  # "@<tag>=<value>..." or ""
    layerwise: bool


class KeyShapes:
    """The key shapes seen per namespace (thread-safe), persisted under ``directory``.

    Args:
        directory: where ``key-shapes.json`` lives (the disk tier's tree), or None to keep
            them in memory only.
    """

    def __init__(self, directory: Path | None = None):
        self._path = None if directory is None else directory / SHAPES_FILE
        self._lock = threading.Lock()
        self._writing = threading.Lock()  # held by the one save under way
        # namespace -> its shapes, the namespace stored into longest ago first
        self._seen: dict[str, set[str]] = {}
        self._count = 0  # shapes of every namespace
        # namespace -> group -> layers seen (empty for whole-chunk groups)
        self._groups: dict[str, dict[_Group, int]] = {}
        self._saved_at = float("-inf")
        self._saving: threading.Timer | None = None  # a save put off (SAVE_INTERVAL_S)
        if self._path is not None:
            self._load()

    def _load(self) -> None:
        assert self._path is not None
        try:
            saved = json.loads(self._path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            logger.warning("kvtier server: ignoring unreadable %s (%s)", self._path, exc)
            return
        if not isinstance(saved, dict):
            return
        for namespace, shapes in saved.items():
            if isinstance(namespace, str) and isinstance(shapes, list):
                for shape in shapes[:MAX_SHAPES_PER_NAMESPACE]:
                    if isinstance(shape, str):
                        self._add(namespace, shape)

    def learn(self, namespace: str, name: str) -> None:
        """Note the shape of ``name`` (a no-op for names that are not kvtier keys)."""
        shape = _shape_of(name)
        if shape is None:
            return
        with self._lock:
            seen = self._seen.pop(namespace, None)
            if seen is not None:  # stored into now: the last to be forgotten
                self._seen[namespace] = seen
            if seen is not None and shape in seen:
                return
            if seen is not None and len(seen) >= MAX_SHAPES_PER_NAMESPACE:
                return
            if not self._add(namespace, shape):
                return
            if self._path is None or self._saving is not None:
                return  # nothing to write, or a save to come writes it
            if time.monotonic() - self._saved_at < SAVE_INTERVAL_S:
                self._saving = threading.Timer(SAVE_INTERVAL_S, self.save)
                self._saving.daemon = True
                self._saving.start()
                return
        self.save()

    def _add(self, namespace: str, shape: str) -> bool:
        parsed = _parse_shape(shape)
        if parsed is None:
            return False
        group, layer = parsed
        while self._count >= MAX_SHAPES:  # forget the namespace stored into longest ago
            oldest = next(iter(self._seen))
            self._count -= len(self._seen.pop(oldest))
            del self._groups[oldest]
        self._seen.setdefault(namespace, set()).add(shape)
        self._count += 1
        groups = self._groups.setdefault(namespace, {})
        groups[group] = max(groups.get(group, 0), 0 if layer is None else layer + 1)
        return True

    def _snapshot(self) -> dict[str, list[str]]:
        return {ns: sorted(shapes) for ns, shapes in self._seen.items()}

    def save(self) -> None:
        """Write the shapes now (one at a time, each what is known when it begins)."""
        with self._writing:
            with self._lock:
                if self._saving is not None:
                    self._saving.cancel()
                    self._saving = None
                self._saved_at = time.monotonic()
                snapshot = self._snapshot()
            self._write(snapshot)

    def close(self) -> None:
        """Write a save put off now (at shutdown)."""
        if self._saving is not None:
            self.save()

    def _write(self, snapshot: dict[str, list[str]]) -> None:
        if self._path is None:
            return
        tmp = self._path.with_name(f".{SHAPES_FILE}.{os.getpid()}.{threading.get_ident()}")
        try:
            tmp.write_text(json.dumps(snapshot), encoding="utf-8")
            os.replace(tmp, self._path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            logger.warning("kvtier server: cannot save %s: %s", self._path, exc)

    def candidates(self, namespace: str, chunk_hash: bytes) -> list[list[str]]:
        """For each shape group of ``namespace``, the names that together hold the chunk."""
        with self._lock:
            groups = list(self._groups.get(namespace, {}).items())
        hex_hash = chunk_hash.hex()
        out = []
        for group, layers in groups:
            names = []
            for rank in range(group.world_size):
                base = f"{group.head}{_SEP}{rank}{_SEP}{group.dtype}{_SEP}{hex_hash}"
                if group.layerwise:
                    names.extend(f"{base}{_SEP}L{layer}{group.tail}" for layer in range(layers))
                else:
                    names.append(base + group.tail)
            out.append(names)
        return out

    def namespaces(self) -> list[str]:
        with self._lock:
            return sorted(self._groups)


def _shape_of(name: str) -> str | None:
    """``name`` with its chunk-hash field emptied, or None when it is not a kvtier key."""
    parts = name.split(_SEP)
    if len(parts) < 6 or parts[0] != KEY_FORMAT:
        return None
    parts[5] = ""
    return _SEP.join(parts)


def _parse_shape(shape: str) -> tuple[_Group, int | None] | None:
    parts = shape.split(_SEP)
    if len(parts) < 6 or parts[0] != KEY_FORMAT or parts[5] != "":
        return None
    try:
        key = CacheKey.from_string(_SEP.join([*parts[:5], "00", *parts[6:]]))
    except ValueError:
        return None
    if key.world_size > 1024 or (key.layer is not None and key.layer >= 4096):
        return None  # not an engine's key; refuse to expand it into thousands of names
    tail = "".join(f"{_SEP}{p}" for p in parts[6:] if not (p.startswith("L") and "=" not in p))
    head = _SEP.join(parts[:3])
    return _Group(head, key.world_size, parts[4], tail, key.layer is not None), key.layer


# -- the request -----------------------------------------------------------------------


class BadLookup(ValueError):
    """A ``/lookup`` request that cannot be answered (the message names the field)."""


@dataclass(frozen=True, slots=True)
class LookupResult:
    cached_tokens: int
    cached_chunks: int
    total_chunks: int
    chunk_size: int

    def as_json(self) -> dict[str, int]:
        return {
            "cached_tokens": self.cached_tokens,
            "cached_chunks": self.cached_chunks,
            "total_chunks": self.total_chunks,
            "chunk_size": self.chunk_size,
        }


def lookup(
    request: dict[str, Any],
    shapes: KeyShapes,
    exists_many: Callable[[str, Sequence[str]], list[bool]],
    *,
    chunk_size: int,
    hash_algorithm: str,
    hash_seed: str,
) -> LookupResult:
    """Answer one ``/lookup`` body.

    Args:
        request: ``{"model": str, "tokens": [int] | "hashes": [hex str], ...}``; optional
            ``chunk_size``, ``hash_algorithm``, ``hash_seed`` (the server's config by
            default), ``cache_salt``, ``lora_name``, ``lora_path``, ``mm_items`` (each
            multimodal item's ``identifier``, ``offset``, ``length``: as the engine
            hashes them), ``num_tokens`` (with ``hashes``: the prompt length, for a
            partial last chunk). A prompt given as embeddings is keyed by them: it is
            looked up by ``hashes`` only (``prompt_embeds`` is refused).
        exists_many: ``(namespace, names) -> [bool]`` over the server's tiers.

    Raises:
        BadLookup: a missing or malformed field, named.
    """
    model = _field(request, "model", str)
    if not model:
        raise BadLookup("'model' must be a non-empty string (the model the engine keys by)")
    chunk_size = _field(request, "chunk_size", int, chunk_size)
    if chunk_size < 1:
        raise BadLookup("'chunk_size' must be >= 1")
    if "prompt_embeds" in request:
        raise BadLookup(
            "'prompt_embeds': a prompt given as embeddings is keyed by them, which a lookup "
            "does not carry: give its 'hashes' (CacheEngine.chunk_keys with the embeddings)"
        )
    if ("tokens" in request) == ("hashes" in request):
        raise BadLookup("give exactly one of 'tokens' (token ids) or 'hashes' (hex strings)")
    if "tokens" in request:
        tokens = _field(request, "tokens", list)
        if not all(type(t) is int and t >= 0 for t in tokens):
            raise BadLookup("'tokens' must be a list of non-negative integers")
        if len(tokens) > MAX_LOOKUP_CHUNKS * chunk_size:
            raise BadLookup(f"'tokens' is longer than {MAX_LOOKUP_CHUNKS} chunks")
        hashes = _hashes_of(request, tokens, chunk_size, hash_algorithm, hash_seed)
        num_tokens = len(tokens)
    else:
        hashes = _parse_hashes(_field(request, "hashes", list))
        num_tokens = _field(request, "num_tokens", int, len(hashes) * chunk_size)
        if hashes and not (len(hashes) - 1) * chunk_size < num_tokens <= len(hashes) * chunk_size:
            raise BadLookup(
                f"'num_tokens'={num_tokens} does not fit {len(hashes)} chunks of {chunk_size}"
            )
    namespace = space_of(model)
    groups_per_chunk = [shapes.candidates(namespace, h) for h in hashes]
    names = sorted({n for groups in groups_per_chunk for group in groups for n in group})
    present = dict(zip(names, exists_many(namespace, names), strict=True)) if names else {}
    held = 0
    for groups in groups_per_chunk:
        if not any(group and all(present[n] for n in group) for group in groups):
            break
        held += 1
    return LookupResult(min(held * chunk_size, num_tokens), held, len(hashes), chunk_size)


def _hashes_of(
    request: dict[str, Any], tokens: list[int], chunk_size: int, algorithm: str, seed: str
) -> list[bytes]:
    algorithm = _field(request, "hash_algorithm", str, algorithm)
    seed = _field(request, "hash_seed", str, seed)
    try:
        hasher = ChunkHasher(algorithm, seed)
    except ValueError as exc:
        raise BadLookup(f"'hash_algorithm': {exc}") from None
    extras = RequestExtras(
        lora_name=_field(request, "lora_name", str, None),
        lora_path=_field(request, "lora_path", str, None),
        cache_salt=_field(request, "cache_salt", str, None),
        mm=_mm_items(_field(request, "mm_items", list, []), len(tokens)),
    )
    template = CacheKey("lookup", 1, 0, "any", b"")
    db = Chunker(chunk_size, hasher, template)
    return db.chunk_hashes(tokens, extras, include_partial=True)


def _mm_items(values: list[Any], num_tokens: int) -> tuple[MultiModalSpan, ...]:
    """``mm_items`` as the engine keys a request's multimodal items (vLLM's
    ``mm_features``: the item's ``identifier``, its placeholder's ``offset`` and
    ``length``), sorted by offset."""
    items = []
    for value in values:
        if not (isinstance(value, dict) and set(value) == {"identifier", "offset", "length"}):
            raise BadLookup(
                '\'mm_items\' must be a list of {"identifier": str, "offset": int, '
                '"length": int} (vLLM\'s mm_features: identifier and mm_position)'
            )
        identifier, offset, length = value["identifier"], value["offset"], value["length"]
        if not (isinstance(identifier, str) and identifier):
            raise BadLookup("'mm_items': an identifier must be a non-empty string")
        if not (type(offset) is int and type(length) is int and offset >= 0 and length > 0):
            raise BadLookup("'mm_items': offset must be an integer >= 0 and length >= 1")
        if offset + length > num_tokens:
            raise BadLookup(
                f"'mm_items': the item at {offset} (length {length}) ends past the "
                f"{num_tokens} tokens"
            )
        items.append(MultiModalSpan(identifier, offset, length))
    return tuple(sorted(items, key=lambda item: item.offset))


def _parse_hashes(values: list[Any]) -> list[bytes]:
    if len(values) > MAX_LOOKUP_CHUNKS:
        raise BadLookup(f"'hashes' has more than {MAX_LOOKUP_CHUNKS} entries")
    try:
        if all(isinstance(v, str) and v for v in values):
            return [bytes.fromhex(v) for v in values]
    except ValueError:
        pass
    raise BadLookup("'hashes' must be a list of chunk hashes as hex strings")


_MISSING = object()


def _field(request: dict[str, Any], name: str, kind: type, default: Any = _MISSING) -> Any:
    value = request.get(name, _MISSING)
    if value is _MISSING or (value is None and default is not _MISSING):
        if default is _MISSING:
            raise BadLookup(f"'{name}' is required")
        return default
    if type(value) is not kind:
        raise BadLookup(f"'{name}' must be of type {kind.__name__}")
    return value
