"""A bounded, thread-safe cache of launch plans, for the ops that keep theirs per process
(RoPE, the rANS coder; the paged copies keep theirs per cache)."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["PlanCache"]


class PlanCache:
    """Launch plans by key, at most ``limit`` of them (the oldest go first). Thread-safe:
    a lookup is one ``dict.get``; storing and clearing take a lock."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._plans: dict[Any, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        """The plan stored under ``key``, or None (TypeError for an unhashable key)."""
        return self._plans.get(key)

    def put(self, key: Any, plan: Any) -> None:
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self.limit:
                del self._plans[next(iter(self._plans))]

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
