"""The notebooks run top to bottom, each in a fresh Python process, and every assertion in
them holds.

``notebooks/NN_name.py`` are jupytext percent scripts: ``# %% [markdown]`` prose cells and
``# %%`` code cells, each notebook ending in a cell of asserted results. Run as plain
Python they need no Jupyter kernel: a notebook passes when ``python notebooks/NN_name.py``
exits 0 within its time limit. The runner itself is tested too: a copy of a notebook whose
last assertion is negated, or one that never finishes, must fail.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
OUTPUT_TAIL_CHARS = 6000

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs vLLM (`make test` installs it)"
)
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter runs here)"
)
needs_transformers = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("transformers", "matplotlib")),
    reason="needs transformers and matplotlib (`make test` installs them)",
)

# name -> (time limit in seconds, marks). Runtimes on the project's 2-core CPU: 01 ~3 s,
# 02 ~15 s, 03 ~7 s, 04 ~25 s; the limits leave room for a slow or busy machine.
NOTEBOOKS: dict[str, tuple[int, list]] = {
    "01_quickstart.py": (120, []),
    "02_vllm_engine.py": (300, [pytest.mark.vllm, needs_vllm]),
    "03_kernels.py": (180, [needs_triton]),
    "04_compression.py": (240, [needs_transformers]),
}


def run_notebook(path: Path, timeout: float) -> subprocess.CompletedProcess:
    """``python path`` in a fresh process from the repository root, output captured."""
    return subprocess.run(
        [sys.executable, str(path)],
        cwd=NOTEBOOKS_DIR.parent,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def check_notebook(path: Path, timeout: float) -> float:
    """Run ``path`` top to bottom; fail the test, with the end of its output, unless it
    exits 0 within ``timeout`` seconds. Returns the seconds it took."""
    start = time.perf_counter()
    try:
        result = run_notebook(path, timeout)
    except subprocess.TimeoutExpired as expired:
        output = _text(expired.stdout) + _text(expired.stderr)
        pytest.fail(
            f"{path.name} did not finish within {timeout} s; its output ended with:\n"
            f"{output[-OUTPUT_TAIL_CHARS:]}"
        )
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        output = f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
        pytest.fail(
            f"{path.name} exited with status {result.returncode} after {seconds:.1f} s; "
            f"its output ended with:\n{output[-OUTPUT_TAIL_CHARS:]}"
        )
    return seconds


def _text(output: bytes | str | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def cells(path: Path) -> list[tuple[str, str]]:
    """``[(kind, source)]`` of a percent-format notebook; kind is "markdown" or "code".
    Text before the first ``# %%`` (the jupytext header) is not a cell."""
    found: list[tuple[str, list[str]]] = []
    for line in path.read_text().splitlines():
        if line.startswith("# %%"):
            found.append(("markdown" if "[markdown]" in line else "code", []))
        elif found:
            found[-1][1].append(line)
    return [(kind, "\n".join(lines).strip()) for kind, lines in found]


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=marks) for name, (_, marks) in NOTEBOOKS.items()]
)
def test_notebook_runs_top_to_bottom(name):
    timeout, _ = NOTEBOOKS[name]
    seconds = check_notebook(NOTEBOOKS_DIR / name, timeout)
    print(f"{name}: {seconds:.1f} s")


def test_every_notebook_is_run():
    on_disk = sorted(path.name for path in NOTEBOOKS_DIR.glob("*.py"))
    assert on_disk == sorted(NOTEBOOKS), "a notebook in notebooks/ is missing from NOTEBOOKS"
    for name in on_disk:
        assert re.fullmatch(r"\d\d_[a-z0-9_]+\.py", name), f"{name}: name it NN_name.py"


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_notebook_is_a_percent_script_ending_in_asserted_results(name):
    path = NOTEBOOKS_DIR / name
    text = path.read_text()
    assert "formats: py:percent" in text.split("# %%", 1)[0], f"{name}: no jupytext header"
    found = cells(path)
    kinds = [kind for kind, _ in found]
    assert kinds[0] == "markdown", f"{name}: the first cell should introduce the notebook"
    assert kinds.count("code") >= 3 and kinds.count("markdown") >= 3, f"{name}: {kinds}"
    assert all(source for _, source in found), f"{name}: an empty cell"
    last_kind, last_source = found[-1]
    asserts = [n for n in ast.walk(ast.parse(last_source)) if isinstance(n, ast.Assert)]
    assert last_kind == "code" and len(asserts) >= 3, f"{name}: should end in asserted results"
    ast.parse(text)  # the whole notebook is one valid Python script


def _negate_last_assert(source: str) -> str:
    """``source`` with its last ``assert X`` turned into ``assert not (X)``."""
    tree = ast.parse(source)
    last = [node for node in ast.walk(tree) if isinstance(node, ast.Assert)][-1]
    last.test = ast.UnaryOp(op=ast.Not(), operand=last.test)
    return ast.unparse(tree)


def test_runner_fails_when_a_notebook_assertion_breaks(tmp_path):
    broken = tmp_path / "01_quickstart.py"
    broken.write_text(_negate_last_assert((NOTEBOOKS_DIR / "01_quickstart.py").read_text()))
    with pytest.raises(pytest.fail.Exception, match="exited with status 1") as failure:
        check_notebook(broken, timeout=NOTEBOOKS["01_quickstart.py"][0])
    message = str(failure.value)
    assert "AssertionError" in message and "01_quickstart.py" in message
    assert "all results as expected" not in message  # it stopped at the broken assertion


def test_runner_fails_when_a_notebook_does_not_finish(tmp_path):
    stuck = tmp_path / "99_stuck.py"
    stuck.write_text("# %%\nprint('started', flush=True)\nimport time\ntime.sleep(60)\n")
    with pytest.raises(pytest.fail.Exception, match="did not finish within 2 s") as failure:
        check_notebook(stuck, timeout=2)
    assert "started" in str(failure.value)
