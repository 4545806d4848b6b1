"""The reliability soak (``perf/soak/soak.py``, ``make soak``) in its short form: about two and
a half minutes of mixed load on a real vLLM engine (CPU build) with kvtier over CPU,
a size-capped disk and a remote, with every fault of its schedule injected once (the
remote killed, a slow and a dropping network path, files truncated, bit-flipped and
deleted, a full disk, the engine SIGKILLed mid-stores and restarted on the same disk).

Every output must equal a no-connector engine's, no request may stall, the disk must stay
under its cap, and every fault must show in kvtier's counters (docs/reliability.md). Memory
and descriptor slopes are not judged: the run ends within the engine's 4-minute warm-up
(``make soak`` judges them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.redis_server import REDIS_MISSING, redis_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.redis,
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not redis_available(), reason=REDIS_MISSING),
]

SOAK = Path(__file__).resolve().parents[2] / "perf" / "soak" / "soak.py"
ROOT = SOAK.parents[2]


def test_short_soak_passes_every_criterion(tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "soak.json"
    env = os.environ.copy()
    env.update(SOAK_SECONDS="150", SOAK_OUT=str(out))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(SOAK)], env=env, capture_output=True, text=True, timeout=1100
    )
    assert out.exists(), f"the soak wrote no result:\n{done.stderr[-4000:]}"
    result = json.loads(out.read_text())
    failed = [name for name, ok in result["criteria"].items() if ok is False]
    assert done.returncode == 0 and not failed, (
        f"failed: {failed}\nfaults: {result['faults']}\nslopes: {result['slopes']}\n"
        f"{done.stderr[-3000:]}"
    )
    assert result["requests"] > 0 and result["wrong_outputs"] == 0
    # every kind of fault of the schedule was injected (a full disk needs a tmpfs mount)
    injected = {kind for kind, f in result["faults"].items() if f["injected"]}
    assert injected >= {
        "kill_remote",
        "slow",
        "drop",
        "truncate",
        "bitflip",
        "delete",
        "kill_engine",
    }, result["faults"]
    assert out.with_suffix(".png").exists()
