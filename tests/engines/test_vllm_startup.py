"""What an operator sees when a real engine starts with kvtier: a config mistake stops the
engine once, with kvtier's message, before vLLM profiles memory or allocates the KV cache."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TESTS = Path(__file__).resolve().parents[1]  # tests/: ``support``


def _start_engine(model: Path, extra: dict) -> subprocess.CompletedProcess:
    program = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from support.engines import make_llm
        if __name__ == "__main__":
            make_llm({str(model)!r}, kvtier={extra!r})
        """
    )
    return subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=600
    )


def test_a_misspelt_key_stops_the_engine_core_once_before_the_kv_cache(model_a):
    proc = _start_engine(model_a, {"chunk_sise": 64})
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "unknown key 'chunk_sise'" in out and "did you mean 'chunk_size'" in out
    # Raised from the engine core's first connector hook, not by each worker after the
    # memory profiling that precedes the connector's construction.
    assert "get_required_kvcache_layout" in out
    assert "Worker failed" not in out
