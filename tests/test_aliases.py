"""Module paths users typed before a module moved keep working, as aliases of the new
ones: the vLLM connector's ``kv_connector_module_path`` values and the documented
Python API."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

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


@pytest.mark.parametrize("path", ["kvtier.integration.vllm", "kvtier.integration.vllm.connector"])
def test_without_vllm_the_connector_says_it_needs_vllm(path: str) -> None:
    """A bare ``pip install kvtier`` has neither vLLM nor the pyzmq it brings: the error
    names vLLM, not pyzmq."""
    program = f"""
        import sys
        sys.modules["vllm"] = sys.modules["zmq"] = None  # neither is installed
        try:
            from {path} import KVTierConnector
        except ImportError as error:
            print(error)
        """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(program)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert "kvtier's vLLM connector needs vLLM" in out, out
