"""Checked puts and gets of chunk objects over a ``StorageManager``: a chunk is checked
(shape, dtype) before anyone uses it, and in paranoid mode (``verify_checksums``) it is
sealed with its checksum when it is stored and verified against it too.

::

    put   allocate ─▶ fill ─▶ seal (checksum, paranoid only) ─▶ StorageManager.put ─▶ release
    get   StorageManager.get_many ─▶ accept (shape, dtype; checksum, paranoid only) ─▶ use
          ─▶ release

The engine's chunks, CacheBlend's segments and SGLang's pages all go through here, so
whether a chunk in kvtier's own memory is checksummed (``seal``) and verified
(``intact``) is decided in this module alone. Bytes that crossed a process boundary are
checked elsewhere, always: a lower tier verifies what it reads against the checksum in
the object's wire header before it returns a chunk (``wire``), and computes that
checksum on its writer threads when the chunk was not sealed (docs/reliability.md).

NOTE: a chunk that fails ``accept`` is a miss: it is counted (``corrupt_chunks``),
logged once and never handed to the engine. One whose bytes changed is removed from every
tier; one of another shape or dtype (another model's, under the same name) only from the
CPU tier, unless its key names its shape (``shape_in_key``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvtier.keys import CacheKey
from kvtier.memory import MemoryObj
from kvtier.observability.stats import Counter
from kvtier.storage.manager import StorageManager
from kvtier.storage.serde import tensor_bytes
from kvtier.storage.wire import checksum_holds, checksum_of
from kvtier.warn import warn_once

logger = logging.getLogger(__name__)


class CheckedChunks:
    """Chunk objects checked on the way out (and sealed on the way in, when verifying).

    Args:
        storage: the tiers (and the counters, ``storage.stats``).
        verify: seal with a checksum and check it (``verify_checksums``): kvtier's own
            memory is then not trusted either. Without it only the shape and dtype are
            checked here (the lower tiers verify what they read in any case).
        noun: what a chunk is called in the log (``chunk``, ``page``).
        shape_in_key: every key names its chunk's whole shape and dtype (CacheBlend's
            segments: the KV geometry tag, the dtype, and a hash of exactly its tokens),
            so one of another shape is no other model's but corrupt: removed from every
            tier, as one whose bytes changed.
    """

    def __init__(
        self,
        storage: StorageManager,
        *,
        verify: bool,
        noun: str = "chunk",
        shape_in_key: bool = False,
    ):
        self.storage = storage
        self.verify = verify
        self.noun = noun
        self.shape_in_key = shape_in_key

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        """A buffer for one chunk, or None when memory is exhausted."""
        return self.storage.allocate(shape, dtype)

    def seal(self, obj: MemoryObj) -> None:
        """Record the checksum of ``obj``'s bytes (when verifying): its bytes are final."""
        if self.verify:
            obj.checksum = checksum_of(tensor_bytes(obj.tensor))

    def put(self, key: CacheKey, obj: MemoryObj) -> bool:
        """Seal ``obj`` and store it under ``key``; the caller keeps its reference.
        Returns whether some tier took it."""
        self.seal(obj)
        return self.storage.put(key, obj)

    def get_many(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        """Each chunk with a reference for the caller, or None; not yet checked
        (``accept`` or ``intact`` before use)."""
        return self.storage.get_many(keys)

    def intact(self, obj: MemoryObj) -> bool:
        """Whether ``obj``'s bytes are as sealed (always, when not verifying)."""
        return not self.verify or checksum_holds(obj)

    def accept(
        self, key: CacheKey, obj: MemoryObj, shape: Sequence[int], dtype: torch.dtype
    ) -> bool:
        """Whether ``obj``, read under ``key``, may be used as a chunk of ``shape`` and
        ``dtype``. One that may not is counted, logged and removed from the tiers; the
        caller still releases its reference."""
        if tuple(obj.shape) != tuple(shape) or obj.dtype != dtype:
            # NOTE: unless the key names the shape, an intact chunk of another KV
            # geometry under this key: another model of the same name sharing a store,
            # written under keys without the geometry tag (keys.geometry_tag). It leaves
            # this engine's memory only; the tiers below keep it for the engine it
            # belongs to.
            problem = f"shape {tuple(obj.shape)} {obj.dtype}, expected {tuple(shape)} {dtype}"
            remove = self.storage.remove if self.shape_in_key else self.storage.cpu.remove
        elif not self.intact(obj):
            problem = "a checksum mismatch (its bytes changed after it was stored)"
            remove = self.storage.remove
        else:
            return True
        self.storage.stats.inc(Counter.CORRUPT_CHUNKS)
        warn_once(logger, f"stored {self.noun} {key} has {problem}: rejected, treated as a miss")
        remove(key)
        return False
