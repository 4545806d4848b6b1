"""``make gpu-bench`` (``perf/gpu_bench.py``) on a machine without a GPU: it refuses at once,
and its steps' bookkeeping (budgets, interruption, results kept, the report of a GPU's
results) works with stand-in steps."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from perf import gpu_bench  # noqa: E402 - the checkout's root is put on the path first

DEVICE = "Fake GPU"


def _run(tmp_path: Path, total: float = 60.0) -> gpu_bench.Run:
    out, results = tmp_path / "out", tmp_path / "results"
    out.mkdir()
    results.mkdir()
    machine = {"device": DEVICE, "cuda": "13.0", "driver": "580.1", "python": "3.12.3"}
    log = open(out / "gpu-bench.log", "w")  # noqa: SIM115 - closed by the fixture's test
    return gpu_bench.Run(out, results, "fake-gpu", machine, total, log, gpu_bench.step_env(None),
                         save=False)  # fmt: skip


def _rows_file(results: Path, device: str = DEVICE) -> str:
    """Python that writes one row dated now into ``<results>/fake-gpu.json``."""
    return textwrap.dedent(f"""
        import datetime, json, pathlib
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        row = dict(metric="engine store (test)", value=40.0, unit="GB/s",
                   baseline="pinned copy", baseline_value=50.0, date=now)
        pathlib.Path({str(results / "fake-gpu.json")!r}).write_text(
            json.dumps({{"machine": {{"device": {device!r}}}, "results": [row]}}))
    """)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_says_so_and_fails(capsys, tmp_path):
    assert gpu_bench.main(["--out", str(tmp_path / "out")]) == gpu_bench.NO_GPU
    err = capsys.readouterr().err
    assert "gpu-bench: no GPU" in err and "docs/performance.md" in err
    assert not (tmp_path / "out").exists()  # nothing written


def test_the_steps_fit_five_minutes(capsys):
    budgets = sum(s.budget for s in gpu_bench.STEPS) + gpu_bench.REPORT.budget
    assert budgets <= gpu_bench.TOTAL_SECONDS <= 300
    assert gpu_bench.main(["--list"]) == 0
    listed = capsys.readouterr().out
    for step in (*gpu_bench.STEPS, gpu_bench.REPORT):
        assert step.name in listed


def test_a_step_past_its_budget_is_interrupted_and_its_rows_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_bench, "GRACE_SECONDS", 5.0)
    monkeypatch.setattr(gpu_bench, "MIN_STEP_SECONDS", 1.0)
    run = _run(tmp_path)
    on_interrupt = textwrap.indent(_rows_file(run.results_dir), "    ")
    code = f"import sys, time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n{on_interrupt}"
    code += "\n    sys.exit(2)\n"
    step = gpu_bench.Step("slow", "a stand-in benchmark", ("-c", code), budget=3.0)
    with run.log:
        result = run.run_step(step, reserve=0)
    assert (result.status, result.exit_code, result.rows) == ("timed out", 2, 1)
    assert result.seconds < 3.0 + 5.0  # interrupted at its budget, ended within the grace
    summary = json.loads((run.out / "gpu-bench.json").read_text())
    assert summary["machine"]["driver"] == "580.1"
    assert summary["results_files"] == ["fake-gpu.json"]
    assert [s["status"] for s in summary["steps"]] == ["timed out"]
    assert json.loads((run.out / "fake-gpu.json").read_text())["results"][0]["value"] == 40.0


def test_a_failing_step_fails_the_run_and_later_steps_still_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_bench, "REPORT", gpu_bench.Step("report", "no report", ("-c", ""), 5))
    run = _run(tmp_path)
    steps = [
        gpu_bench.Step("bad", "fails", ("-c", "raise SystemExit(3)"), budget=20.0),
        gpu_bench.Step("good", "writes a row", ("-c", _rows_file(run.results_dir)), budget=20.0),
    ]
    with run.log:
        assert gpu_bench.run_all(run, steps) == 1
    summary = json.loads((run.out / "gpu-bench.json").read_text())
    assert summary["status"] == "failed"
    assert [(s["name"], s["status"], s["exit_code"]) for s in summary["steps"][:2]] == [
        ("bad", "failed", 3),
        ("good", "passed", 0),
    ]
    assert summary["steps"][1]["rows"] == 1
    assert "bad          failed" in capsys.readouterr().out


def test_a_step_is_not_started_past_the_runs_budget(tmp_path):
    run = _run(tmp_path, total=5.0)
    step = gpu_bench.Step("late", "never runs", ("-c", "raise SystemExit(1)"), budget=20.0)
    with run.log:
        result = run.run_step(step, reserve=0)
    assert result.status == "not run" and result.exit_code is None
    assert "not started" in result.note


def test_the_report_of_a_gpu_results_file(tmp_path):
    pytest.importorskip("matplotlib")
    run = _run(tmp_path)
    machine = {**run.machine, "date": "2030-01-01T00:00:00+00:00", "torch": "2.11.0+cu130"}
    rows = [
        {"metric": "engine store (GPU pages → pinned CPU tier, default config)", "value": 6.5,
         "unit": "GB/s", "baseline": "pinned copy_(non_blocking=True), device to host",
         "baseline_value": 54.5},
        {"metric": "wall_us_per_call", "value": 20.0, "unit": "us",
         "baseline": "GPU kernel time per call (torch.profiler)", "baseline_value": 18.5},
    ]  # fmt: skip
    (run.results_dir / "fake-gpu.json").write_text(
        json.dumps({"machine": machine, "results": rows})
    )
    (run.results_dir / "cpu.json").write_text(json.dumps({"machine": {}, "results": []}))
    with run.log:
        result = run.run_step(gpu_bench.REPORT, reserve=0)
    assert result.status == "passed", result.tail
    report = (run.out / "report.md").read_text()
    assert f"### {DEVICE}" in report and "cuda 13.0, driver 580.1" in report
    assert "| engine | store (GPU pages → pinned CPU tier, default config) | 6.50 |" in report
    assert "| wall_us_per_call | — | — | 20.0 | GPU kernel time per call" in report
    assert "cpu.json" not in report  # this device's files alone


def test_rows_of_an_earlier_step_in_the_same_second_are_not_counted_again(tmp_path, monkeypatch):
    """A step's rows are those it wrote: a row an earlier step dated in the second this step
    started in is not this step's, and a step that wrote none measured nothing."""
    monkeypatch.setattr(gpu_bench, "_now", lambda: "2030-01-01T00:00:00+00:00")
    run = _run(tmp_path)
    writes = _rows_file(run.results_dir).replace("now = datetime", "_ = datetime")
    writes = writes.replace("date=now", "date='2030-01-01T00:00:00+00:00'")
    steps = [
        gpu_bench.Step("first", "writes a row", ("-c", writes), budget=20.0),
        gpu_bench.Step("second", "writes none", ("-c", ""), budget=20.0),
    ]
    with run.log:
        first, second = (run.run_step(step, reserve=0) for step in steps)
    assert (first.status, first.rows) == ("passed", 1)
    assert (second.status, second.rows) == ("no rows", 0)


@pytest.mark.parametrize("scratch", [False, True], ids=["save", "scratch"])
def test_a_run_with_a_gpu_saves_its_rows_under_the_devices_name(tmp_path, monkeypatch, scratch):
    """``main`` on a machine that has a GPU (stand-in steps): the benchmarks are asked to
    save (not with ``--scratch``), and the output folder gets the device's results files
    as ``docs/performance.md`` lists them, with the summary and the log."""
    from perf.benchmarks import machine_info

    results = tmp_path / "results"
    (results / "scratch").mkdir(parents=True)
    monkeypatch.setattr(gpu_bench, "RESULTS_DIR", results)
    monkeypatch.setattr(gpu_bench, "missing_gpu", lambda: None)
    monkeypatch.setattr(machine_info, "describe_machine", lambda date: {"device": "NVIDIA H200"})
    to = results / "scratch" if scratch else results
    rows = _rows_file(to).replace("fake-gpu.json", "nvidia-h200.json")
    saves = "import sys; assert ('--save-results' in sys.argv) == {save!r}, sys.argv\n"
    saves = saves.format(save=not scratch)
    monkeypatch.setattr(gpu_bench, "STEPS", (
        gpu_bench.Step("tests", "no rows to save", ("-c", ""), 20, saves=False, parallel=True),
        gpu_bench.Step("kernels", "one row", ("-c", saves + rows), 20),
        gpu_bench.Step("launch", "one row", ("-c", saves + rows.replace(".json", "-launch.json")), 20),
    ))  # fmt: skip
    monkeypatch.setattr(gpu_bench, "REPORT", gpu_bench.Step("report", "none", ("-c", ""), 20))
    out = tmp_path / "out"
    args = ["--out", str(out), "--wheels", str(tmp_path / "none")] + ["--scratch"] * scratch
    assert gpu_bench.main(args) == 0
    summary = json.loads((out / "gpu-bench.json").read_text())
    assert summary["results_files"] == ["nvidia-h200.json", "nvidia-h200-launch.json"]
    assert [(s["name"], s["status"], s["rows"]) for s in summary["steps"][:3]] == [
        ("tests", "passed", 0),
        ("kernels", "passed", 1),
        ("launch", "passed", 1),
    ]
    assert {"gpu-bench.log", "nvidia-h200.json", "nvidia-h200-launch.json"} <= {
        p.name for p in out.iterdir()
    }
