"""Logging without flooding: a problem that repeats (a bad tier, a down server) is
logged once per distinct message, and counted in metrics every time."""

from __future__ import annotations

import logging
import threading

_lock = threading.Lock()
_seen: set[str] = set()
_MAX_REMEMBERED = 10_000  # bound memory when messages carry keys or paths


def warn_once(
    logger: logging.Logger,
    message: str,
    *,
    key: str | None = None,
    exc_info: BaseException | None = None,
) -> bool:
    """Log ``message`` at WARNING the first time its ``key`` (default: the message) is
    seen, with ``exc_info``'s traceback when given; returns whether it was logged."""
    key = message if key is None else key
    with _lock:
        if key in _seen:
            return False
        if len(_seen) >= _MAX_REMEMBERED:
            _seen.clear()
        _seen.add(key)
    logger.warning(message, exc_info=exc_info)
    return True
