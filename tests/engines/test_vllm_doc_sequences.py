"""Every command sequence the documentation shows (``docs/sequences/*.sh``, shown byte for
byte between sequence markers: ``tests/test_doc_sequences.py``) runs as written, with real
vLLM OpenAI servers (CPU build), ``kvtier serve`` and ``kvtier proxy``.

``MODEL`` is a tiny random-weight Llama built here with a word tokenizer of its own
(nothing is downloaded). The test sets only what each script reads from the environment
with a default: a free port for every ``*PORT*`` variable, and small sizes for the KV
cache and the pools where the script has them; ``python`` and ``kvtier`` are this
interpreter. A script passes when it exits 0, printed at least one ``ok:`` check line and
no ``FAIL:`` line, and left no process of its own running.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.doc_sequences import ROOT, defaults, scripts
from support.models import add_word_tokenizer, make_tiny_llama
from support.redis_server import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SCRIPT_S = 600  # two engines starting at once on a busy 2-core machine
# Small enough for CI, for the variables a script reads (the defaults suit a laptop).
SMALL = {
    "KV_CACHE_BYTES": str(64 << 20),
    "POOL_GB": "0.25",
    "SERVER_POOL_GB": "0.25",
    "VLLM_ARGS": "--enforce-eager",  # no compilation: engines start in seconds, not minutes
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    pytest.importorskip("vllm")
    return add_word_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("models") / "llama-doc"))


@pytest.fixture(scope="module")
def commands(tmp_path_factory) -> Path:
    """A directory whose ``python`` and ``kvtier`` are this interpreter and its kvtier."""
    bin_dir = tmp_path_factory.mktemp("bin")
    for name, command in (("python", ""), ("kvtier", " -m kvtier")):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec {sys.executable}{command} "$@"\n')
        shim.chmod(0o755)
    return bin_dir


def environment(script: Path, model: Path, commands: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PATH"] = os.pathsep.join([str(commands), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["MODEL"] = str(model)
    for name in defaults(script):
        if "PORT" in name:
            env[name] = str(free_port())
        elif name in SMALL:
            env[name] = SMALL[name]
    return env


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.parametrize("script", scripts(), ids=lambda s: s.name)
def test_a_documented_sequence_runs_as_written(script, model, commands, tmp_path):
    assert shutil.which("curl"), "the documented sequences use curl"
    log = tmp_path / "output.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            ["bash", str(script)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environment(script, model, commands),
            cwd=tmp_path,
            start_new_session=True,  # its own process group: nothing outlives the test
        )
    try:
        returncode = process.wait(timeout=SCRIPT_S)
        deadline = time.monotonic() + 60  # the trap stops what the script started
        while group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        left_running = group_alive(process.pid)
    except subprocess.TimeoutExpired:
        returncode, left_running = None, False
    finally:
        if group_alive(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
    output = log.read_text(errors="replace")
    checks = [line for line in output.splitlines() if line.startswith(("ok: ", "FAIL: "))]
    failed = [line for line in checks if line.startswith("FAIL: ")]
    assert returncode == 0 and checks and not failed, (
        f"{script.name}: exit status {returncode}, checks {checks}\n{output[-6000:]}"
    )
    assert not left_running, f"{script.name} left processes running after it exited"
