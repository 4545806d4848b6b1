"""Module paths users typed before a module moved keep working, as aliases of the new
ones: the vLLM connector's ``kv_connector_module_path`` values and the documented
Python API."""

from __future__ import annotations

import importlib

import pytest

ALIASES = [
    ("kvtier.prometheus", "kvtier.observability.prometheus", "serve_engine_metrics"),
    ("kvtier.prometheus", "kvtier.observability.prometheus", "MetricsServer"),
    ("kvtier.metrics", "kvtier.observability.stats", "Counter"),
    ("kvtier.metrics", "kvtier.observability.stats", "Stats"),
    ("kvtier.config", "kvtier.config", "load_config"),
]


@pytest.mark.parametrize(("old", "new", "name"), ALIASES)
def test_an_old_path_names_the_same_object(old: str, new: str, name: str) -> None:
    assert getattr(importlib.import_module(old), name) is getattr(
        importlib.import_module(new), name
    )


@pytest.mark.parametrize("path", ["kvtier.integration.vllm", "kvtier.integration.vllm.connector"])
def test_both_connector_module_paths_give_the_connector(path: str) -> None:
    pytest.importorskip("vllm")
    from kvtier.integration.vllm.connector import KVTierConnector

    assert importlib.import_module(path).KVTierConnector is KVTierConnector
