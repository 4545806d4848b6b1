"""The level of kvtier's loggers, which ``KVTIER_LOG_LEVEL`` sets in every process kvtier
runs in.

``KVTIER_LOG_LEVEL`` (debug, info, warning, error or critical, in any case) sets the
``kvtier`` logger's level in the vLLM connector's scheduler and workers, the SGLang
backend, ``kvtier serve``, ``kvtier proxy`` and the other commands, whatever level the
process gives its other loggers. Unset (or empty), each process keeps its own default:
INFO in a vLLM engine, ``kvtier serve`` and ``kvtier proxy`` (its ``--log-level``); a bad
value is an error that names the variable.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

LOG_LEVEL_ENV_VAR = "KVTIER_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error", "critical")
KVTIER_LOGGER = "kvtier"


def env_log_level(environ: Mapping[str, str] | None = None) -> int | None:
    """The level ``KVTIER_LOG_LEVEL`` names in ``environ`` (default ``os.environ``);
    None when it is unset or empty.

    Raises:
        ValueError: not a level (naming the variable and the levels).
    """
    raw = (os.environ if environ is None else environ).get(LOG_LEVEL_ENV_VAR, "")
    name = raw.strip().lower()
    if not name:
        return None
    if name not in LEVELS:
        raise ValueError(
            f"{LOG_LEVEL_ENV_VAR}={raw!r}: not a log level; expected one of {', '.join(LEVELS)}"
        )
    return logging.getLevelName(name.upper())


def set_kvtier_log_level(environ: Mapping[str, str] | None = None) -> int | None:
    """Set the ``kvtier`` logger to ``KVTIER_LOG_LEVEL``'s level when it is set; returns
    that level (None: left as it was).

    Raises:
        ValueError: ``KVTIER_LOG_LEVEL`` is not a level.
    """
    level = env_log_level(environ)
    if level is not None:
        logging.getLogger(KVTIER_LOGGER).setLevel(level)
    return level


def show_kvtier_logs() -> None:
    """Set the ``kvtier`` logger's level (``KVTIER_LOG_LEVEL``, else INFO) and give it a
    handler when nothing else configured one: vLLM configures only its own loggers, and
    kvtier's start-up lines (the config in effect, the layout found) belong in the
    engine's log.

    Raises:
        ValueError: ``KVTIER_LOG_LEVEL`` is not a level.
    """
    level = set_kvtier_log_level()
    root = logging.getLogger(KVTIER_LOGGER)
    if root.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("(kvtier) %(levelname)s %(asctime)s %(message)s"))
    root.addHandler(handler)
    if level is None:
        root.setLevel(logging.INFO)
