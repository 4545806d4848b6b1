"""Logging without flooding: a problem that repeats (a bad tier, a down server) is
logged once per distinct message, and counted in metrics every time."""

from __future__ import annotations

import logging
import threading

_lock = threading.Lock()
_seen: set[str] = set()
_MAX_REMEMBERED = 10_000  # bound memory when messages carry keys or paths


def warn_once(logger: logging.Logger, message: str) -> bool:
    """Log ``message`` at WARNING the first time it is seen; returns whether it was."""
    with _lock:
        if message in _seen:
            return False
        if len(_seen) >= _MAX_REMEMBERED:
            _seen.clear()
        _seen.add(message)
    logger.warning(message)
    return True
