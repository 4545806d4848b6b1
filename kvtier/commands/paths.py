"""Whether a directory a command is to create or write into can be: the check that
``kvtier info`` (``local_disk``) and ``kvtier tune`` (``--out``) make before any work."""

from __future__ import annotations

import os
from pathlib import Path


def why_not_writable(directory: Path) -> str | None:
    """Why files cannot be written into ``directory`` (created when missing: its nearest
    existing ancestor must be a writable directory), or None."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user"
    return None
