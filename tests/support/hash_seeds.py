"""Running a snippet in fresh Python processes under several ``PYTHONHASHSEED`` values, for
the tests that prove kvtier's hashes and keys do not depend on Python's own hashing."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence


def same_output_under_hash_seeds(code: str, seeds: Sequence[str]) -> str:
    """The standard output of ``python -c code``, which must be the same under every
    ``PYTHONHASHSEED`` of ``seeds``."""
    outputs = set()
    for seed in seeds:
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout
        outputs.add(out)
    assert len(outputs) == 1, outputs
    return next(iter(outputs))
