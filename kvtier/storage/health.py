"""Whether a remote store answers, and the reconnect that notices when it does again: the
one health policy of every remote kvtier talks to (an engine's remote tier, and the
remote behind a ``kvtier serve``).

States::

          a call fails or times out                  a ping answers
    UP ──────────────────────────────▶ DOWN ──────────────────────────▶ UP
    calls go to the store              the owner answers at once (a miss, a
                                       dropped write); a background thread pings
                                       with backoff (0.1 s doubling, up to
                                       reconnect_max_s)

One warning is logged per outage and one line when service returns, on the owner's
logger.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout

from kvtier.storage.blob_store import StoreUnavailable

RECONNECT_FIRST_S = 0.1


def fault_reason(what: str, exc: BaseException, timeout_s: float) -> str:
    """Why a call ``what`` failed, for the outage's log line."""
    if isinstance(exc, FutureTimeout):
        return f"{what} took longer than {timeout_s * 1000:.0f} ms"
    if isinstance(exc, StoreUnavailable):
        return str(exc)
    return f"{what} failed: {type(exc).__name__}: {exc}"


class Health:
    """The up/down state of one remote store (see the module docstring). Thread-safe.

    Args:
        name: short name for the reconnect thread (``redis``).
        subject: how the log names the store (``kvtier redis tier redis://h:6379``).
        ping: returns when the store answers, raises when it does not.
        reconnect_max_s: the longest pause between pings while down.
        logger: where the outage and the return are logged.
        on_reconnect: called each time the store answers again (to count it).
    """

    def __init__(
        self,
        name: str,
        subject: str,
        ping: Callable[[], object],
        *,
        reconnect_max_s: float,
        logger: logging.Logger,
        on_reconnect: Callable[[], object] | None = None,
    ):
        self.name = name
        self.subject = subject
        self._ping = ping
        self.reconnect_max_s = max(reconnect_max_s, RECONNECT_FIRST_S)
        self._logger = logger
        self._on_reconnect = on_reconnect
        self._lock = threading.Lock()
        self._up = True
        self._stop = threading.Event()
        self._reconnector: threading.Thread | None = None

    @property
    def is_up(self) -> bool:
        return self._up

    def mark_down(self, reason: str) -> None:
        """The store failed: down until a ping answers (nothing to do if it is down
        already or closed)."""
        with self._lock:
            if not self._up or self._stop.is_set():
                return
            self._up = False
            self._reconnector = threading.Thread(
                target=self._reconnect, name=f"kvtier-{self.name}-reconnect", daemon=True
            )
            self._reconnector.start()
        self._logger.warning(
            "%s is unavailable (%s): lookups and loads are misses and stores are dropped "
            "until it answers again",
            self.subject,
            reason,
        )

    def _reconnect(self) -> None:
        down_since = time.monotonic()
        pause = RECONNECT_FIRST_S
        while not self._stop.wait(pause):
            try:
                self._ping()
            except Exception:
                pause = min(pause * 2, self.reconnect_max_s)
                continue
            with self._lock:
                self._up = True
            if self._on_reconnect is not None:
                self._on_reconnect()
            self._logger.warning(
                "%s is available again after %.1f s", self.subject, time.monotonic() - down_since
            )
            return

    def close(self) -> None:
        """Stop reconnecting (idempotent)."""
        with self._lock:
            self._stop.set()
        if self._reconnector is not None:
            self._reconnector.join(timeout=self.reconnect_max_s + 1)
