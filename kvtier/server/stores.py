"""``OpenStores``: the stores a server keeps open, one per client namespace, at most
``MAX_OPEN_STORES`` at once (its remote's, and each peer's).

Each store holds a client of the remote and its connections (file descriptors): a
server that opened one for every namespace a client ever named would run out of them.
Past the bound, the store used longest ago is closed, once no call is using it, and
opened again when its namespace is next asked for (the remote's objects stay).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvtier.storage.blob_store import BlobStore

MAX_OPEN_STORES = 64
S = TypeVar("S", bound=BlobStore)


@dataclass(slots=True)
class _Opened(Generic[S]):
    store: S
    users: int = 0  # calls using it now
    retired: bool = False  # past the bound: closed once unused


class OpenStores(Generic[S]):
    """The store of each namespace, opened on first use; thread-safe.

    Args:
        open_store: the store of a namespace (cheap: a store connects on its first call);
            what it raises, ``using`` raises, nothing opened.
        capacity: the most stores kept open once unused.
    """

    def __init__(self, open_store: Callable[[str], S], capacity: int = MAX_OPEN_STORES):
        self._open_store = open_store
        self.capacity = capacity
        self._lock = threading.Lock()
        self._open: dict[str, _Opened[S]] = {}  # the one used longest ago first
        self._retired: list[_Opened[S]] = []  # closed when their last call ends
        self._named: set[str] = set()  # every namespace opened (``clear`` of all)

    @contextlib.contextmanager
    def using(self, namespace: str) -> Iterator[S]:
        """The store of ``namespace``, not closed before the block ends."""
        with self._lock:
            opened = self._open.pop(namespace, None)
            if opened is None:
                opened = _Opened(self._open_store(namespace))
                self._named.add(namespace)
            self._open[namespace] = opened
            opened.users += 1
            idle = self._retire()
        for old in idle:
            old.close()
        try:
            yield opened.store
        finally:
            with self._lock:
                opened.users -= 1
                done = opened.retired and not opened.users
                if done:
                    self._retired.remove(opened)
            if done:
                opened.store.close()

    def _retire(self) -> list[S]:
        """Take the stores used longest ago past ``capacity`` out; those unused to close."""
        idle = []
        while len(self._open) > self.capacity:
            old = self._open.pop(next(iter(self._open)))
            if old.users:
                old.retired = True
                self._retired.append(old)
            else:
                idle.append(old.store)
        return idle

    def latest(self) -> str | None:
        """The namespace whose store was used last, if one is open."""
        with self._lock:
            return next(reversed(self._open), None)

    def stores(self) -> dict[str, S]:
        """The stores open now, by namespace."""
        with self._lock:
            return {name: opened.store for name, opened in self._open.items()}

    def namespaces(self) -> list[str]:
        """Every namespace a store was opened for."""
        with self._lock:
            return sorted(self._named)

    def __len__(self) -> int:
        return len(self._open)

    def close(self) -> None:
        with self._lock:
            stores = [o.store for o in [*self._open.values(), *self._retired]]
            self._open, self._retired = {}, []
        for store in stores:
            store.close()
