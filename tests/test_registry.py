"""The op registry: lazy loading, backend resolution, error messages."""

from __future__ import annotations

import importlib.util
import itertools
import subprocess
import sys

import pytest
import torch

from kvtier_kernels import registry
from kvtier_kernels.paged import copy as paged_copy

HAS_TRITON = importlib.util.find_spec("triton") is not None
_names = itertools.count()


def fresh_op() -> str:
    """A name no other test registered (the registry is process-global)."""
    return f"test_op_{next(_names)}"


@pytest.fixture(autouse=True)
def own_registry(monkeypatch):
    """The ops a test registers are gone after it: later tests (``kvtier info`` lists
    every op) see kvtier's ops only."""
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))


def test_paged_copy_ops_are_registered() -> None:
    assert {"paged_gather", "paged_scatter"} <= set(registry.ops())
    assert "torch" in registry.backends_for("paged_gather")
    assert registry.get("paged_gather", "torch") is paged_copy.gather_torch
    cpu = torch.device("cpu")
    assert "numba" in registry.registered("paged_scatter")
    picked = registry.pick("paged_scatter", "auto", cpu)  # numba where it imports, else torch
    assert picked == ("numba" if "numba" in registry.backends_for("paged_scatter") else "torch")
    assert registry.get("paged_scatter", "auto", cpu) is registry.get("paged_scatter", picked)


def test_lazy_loader_runs_once_on_first_get() -> None:
    op, calls = fresh_op(), []

    def impl() -> str:
        return "ran"

    def loader():
        calls.append(1)
        return impl

    registry.register(op, "torch", loader=loader)
    assert calls == []
    assert registry.backends_for(op) == ["torch"]  # listing does not load
    assert registry.get(op, "torch") is impl
    assert registry.get(op) is impl
    assert calls == [1]


def test_failing_loader_raises_and_is_retried() -> None:
    op, calls = fresh_op(), []

    def loader():
        calls.append(1)
        if len(calls) == 1:
            raise ImportError("triton too old")
        return print

    registry.register(op, "torch", loader=loader)
    with pytest.raises(ImportError, match="triton too old"):
        registry.get(op, "torch")
    assert registry.get(op, "torch") is print
    assert len(calls) == 2


def test_loader_must_return_a_callable() -> None:
    op = fresh_op()
    registry.register(op, "torch", loader=lambda: 42)
    with pytest.raises(TypeError, match=rf"loader for \('{op}', 'torch'\) returned 42"):
        registry.get(op, "torch")


def test_auto_resolution() -> None:
    assert registry.resolve_backend("auto", torch.device("cpu")) == "torch"
    assert registry.resolve_backend("auto", None) == "torch"
    assert registry.resolve_backend("torch", "cuda") == "torch"
    # A CUDA device object needs no GPU; auto picks triton when triton is installed.
    expected = "triton" if HAS_TRITON else "torch"
    assert registry.resolve_backend("auto", torch.device("cuda", 0)) == expected
    if HAS_TRITON:
        assert registry.resolve_backend("interpret", "cpu") == "interpret"


def test_auto_falls_back_to_torch_when_op_has_no_triton_kernel() -> None:
    op = fresh_op()
    registry.register(op, "torch", print)
    assert registry.get(op, "auto", torch.device("cuda")) is print
    if HAS_TRITON:
        with pytest.raises(
            ValueError, match=rf"op '{op}' has no 'triton' implementation; it has: \['torch'\]"
        ):
            registry.get(op, "triton", torch.device("cuda"))


def test_triton_on_cpu_suggests_interpret_or_torch() -> None:
    with pytest.raises(ValueError, match=r"cannot run on device 'cpu'.*'interpret'.*'torch'"):
        registry.resolve_backend("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="'interpret'"):
        registry.get("paged_gather", "triton", torch.device("cpu"))


def test_unknown_names_are_listed() -> None:
    with pytest.raises(KeyError, match=r"unknown kernel op 'no_such_op'.*paged_gather"):
        registry.get("no_such_op")
    with pytest.raises(KeyError, match="paged_scatter"):
        registry.backends_for("no_such_op")
    with pytest.raises(
        ValueError,
        match=r"unknown kernel backend 'gpu'; choose one of "
        r"\('auto', 'torch', 'triton', 'interpret', 'numba'\)",
    ):
        registry.get("paged_gather", "gpu")
    op = fresh_op()
    registry.register(op, "interpret", print)
    with pytest.raises(
        ValueError, match=rf"op '{op}' has no 'torch' implementation; it has: \['interpret'\]"
    ):
        registry.get(op, "torch")


def test_register_validates() -> None:
    op = fresh_op()
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        registry.register(op, "cuda", print)
    with pytest.raises(ValueError, match="exactly one of fn and loader"):
        registry.register(op, "torch")
    with pytest.raises(ValueError, match="exactly one of fn and loader"):
        registry.register(op, "torch", print, loader=lambda: print)
    registry.register(op, "torch", print)
    with pytest.raises(ValueError, match=rf"op '{op}' already has a 'torch' implementation"):
        registry.register(op, "torch", repr)
    registry.register(op, "torch", repr, replace=True)
    assert registry.get(op, "torch") is repr
    assert op in registry.ops()


def test_available_backends_does_not_initialise_cuda() -> None:
    status = registry.available_backends()
    assert set(status) == set(registry.BACKENDS)
    assert status["torch"] == "available"
    if not torch.cuda.is_available():
        assert status["triton"].startswith("no GPU")
    assert not torch.cuda.is_initialized()


def test_import_does_not_import_triton_numba_or_kvtier() -> None:
    code = (
        "import sys, kvtier_kernels\n"
        "from kvtier_kernels import cachegen, registry\n"
        "registry.available_backends()\n"
        "registry.backends_for('rans_encode')\n"
        "registry.get('paged_gather', 'torch', None)\n"
        "top = ('triton', 'numba', 'kvtier', 'vllm')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in top)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_backends_for_lists_only_what_can_run_here(monkeypatch) -> None:
    """Compiled Triton needs Triton and a GPU; the interpreter needs Triton only."""
    monkeypatch.setattr(registry, "_numba_installed", lambda: False)
    monkeypatch.setattr(registry, "_triton_installed", lambda: True)
    monkeypatch.setattr(registry, "_gpu_kind", lambda: None)
    assert registry.backends_for("paged_gather") == ["torch", "interpret"]
    monkeypatch.setattr(registry, "_gpu_kind", lambda: "ROCm")
    assert registry.backends_for("paged_gather") == ["torch", "triton", "interpret"]
    monkeypatch.setattr(registry, "_triton_installed", lambda: False)
    assert registry.backends_for("paged_gather") == ["torch"]


@pytest.fixture
def numba_op(monkeypatch):
    """An op with torch and numba implementations, numba installed and importable."""
    op = fresh_op()
    registry.register(op, "torch", print)
    registry.register(op, "numba", loader=lambda: repr)
    monkeypatch.setattr(registry, "_numba_installed", lambda: True)
    monkeypatch.setattr(registry, "_numba_error", None)
    return op


def test_auto_picks_numba_off_the_gpu(numba_op) -> None:
    assert registry.pick(numba_op, "auto", torch.device("cpu")) == "numba"
    assert registry.get(numba_op, "auto", torch.device("cpu")) is repr
    assert registry.get(numba_op, "torch") is print  # an explicit backend is itself
    assert registry.get(numba_op, "numba", None) is repr
    assert registry.backends_for(numba_op) == ["torch", "numba"]
    assert registry.registered(numba_op) == ["torch", "numba"]
    if HAS_TRITON:
        assert registry.pick(numba_op, "auto", torch.device("cuda")) == "torch"  # no kernel
    assert registry.pick("paged_gather", "auto", torch.device("cpu")) == "numba"


def test_auto_falls_back_to_torch_where_numba_does_not_import(numba_op, monkeypatch) -> None:
    monkeypatch.setattr(registry, "_numba_error", "ImportError: Numba needs NumPy 2.2")
    assert registry.pick(numba_op, "auto", torch.device("cpu")) == "torch"
    assert registry.get(numba_op, "auto", torch.device("cpu")) is print
    assert registry.backends_for(numba_op) == ["torch"]
    status = registry.available_backends()["numba"]
    assert "installed but unusable (ImportError: Numba needs NumPy 2.2)" in status
    monkeypatch.setattr(registry, "_numba_installed", lambda: False)
    assert registry.available_backends()["numba"].startswith("numba not installed")
    with pytest.raises(ValueError, match=r"'numba' needs numba, which is not installed"):
        registry.get(numba_op, "numba")


def test_numba_import_is_tried_once_and_disable_jit_counts_as_failure(monkeypatch) -> None:
    numba = pytest.importorskip("numba")
    monkeypatch.setattr(registry, "_numba_error", registry._NOT_TRIED)
    monkeypatch.setattr(numba.config, "DISABLE_JIT", True)
    assert not registry._numba_imports()
    assert registry._numba_error == "NUMBA_DISABLE_JIT is set"
    monkeypatch.setattr(numba.config, "DISABLE_JIT", False)
    assert not registry._numba_imports()  # kept: tried once per process
