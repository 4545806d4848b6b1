"""A pytest plugin (``-p support.without_blend``) that runs tests as if CacheBlend had been
deleted: ``kvtier.blend`` cannot be imported and its line is gone from the connector's
extension registry. ``test_vllm_extensions`` runs the connector's own tests under it."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

import pytest


class _NoBlend(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "kvtier.blend" or name.startswith("kvtier.blend."):
            raise ImportError(f"{name}: CacheBlend is deleted in this run")
        return None


sys.meta_path.insert(0, _NoBlend())

from kvtier.integration.vllm import extensions  # noqa: E402

extensions.EXTENSIONS = tuple(e for e in extensions.EXTENSIONS if e.name != "blend")

if importlib.util.find_spec("vllm") is not None:
    import kvtier.integration.vllm.connector  # noqa: F401  (the facade vLLM loads)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    loaded = sorted(name for name in sys.modules if name.startswith("kvtier.blend"))
    if loaded:
        raise RuntimeError(f"CacheBlend modules were loaded: {loaded}")
