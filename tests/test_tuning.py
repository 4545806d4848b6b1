"""Kernel tuning: the sweep / check / time / write pipeline, the tuning files and their
lookup by the launchers, and the ``kvtier kernels`` / ``kvtier tune`` commands.

There is no GPU here, so the pipeline runs with the ``interpret`` backend on CPU tensors,
tiny shapes and a fake timer (the ``kvtier tune`` command itself refuses without a GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.kv import assert_chunk_equal, fill_random_

from kvtier.cli import main
from kvtier_kernels import registry
from kvtier_kernels._launch import check_launch_config
from kvtier_kernels.layouts import PagedKV
from kvtier_kernels.paged import copy as paged_copy
from kvtier_kernels.paged.copy import LaunchConfig as CopyConfig
from kvtier_kernels.rope import rerotation
from kvtier_kernels.rope.rerotation import LaunchConfig as RopeConfig
from kvtier_kernels.tuning import files as tuning_files
from kvtier_kernels.tuning import lookup as tuning_lookup
from kvtier_kernels.tuning import sweep
from kvtier_kernels.tuning.copy_engine import find_crossover, measure_copy_engine
from kvtier_kernels.tuning.files import TuningEntry, TuningFile
from kvtier_kernels.tuning.paged import PagedCopyProblem, paged_copy_candidates
from kvtier_kernels.tuning.rope import RopeProblem, rope_candidates
from kvtier_kernels.tuning.shapes import ModelShape, model_shape_from_config

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (interpreter)"
)

CPU = torch.device("cpu")
# 2 layers x 1 head x 8 bf16: a row is 16 bytes, two int64 words; one program per launch.
TINY = ModelShape(
    num_layers=2, num_kv_heads=1, head_size=8, block_size=2, chunk_size=4, dtype=torch.bfloat16
)
KVTIER = os.path.join(os.path.dirname(sys.executable), "kvtier")


@pytest.fixture
def tuning_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty user tuning directory (KVTIER_TUNING_DIR) and no packaged defaults."""
    directory = tmp_path / "tuning"
    monkeypatch.setenv(tuning_lookup.TUNING_DIR_ENV, str(directory))
    monkeypatch.setattr(tuning_lookup, "PACKAGED_DIR", tmp_path / "no-packaged-defaults")
    tuning_lookup.clear_cache()
    yield directory
    tuning_lookup.clear_cache()


def fake_timer(times: dict[object, float]):
    """A timer that runs ``fn`` once and reports ``times[config]`` (default 5 us)."""

    def timer(fn, warmup: int, repeats: int) -> list[float]:
        fn()
        config = fn.args[0] if isinstance(fn, functools.partial) else None
        return [times.get(config, 5e-6)] * repeats

    return timer


def corrupting(op: str, bad: object):
    """The op's interpret implementation, writing one wrong value when run with ``bad``."""
    real = registry.get(op, "interpret", CPU)

    def impl(*args, config, **kwargs):
        result = real(*args, config=config, **kwargs)
        if config == bad:  # flip one bit / add 1.0 to one key
            if op == "paged_gather":
                args[2].view(torch.int16)[0, 0, 1, 0] ^= 1  # chunk [KV, L, T, H * D]
            elif op == "paged_scatter":
                args[0].layer_view(1)[1, 0, 0, 0, 0].view(torch.int16).bitwise_xor_(1)
            else:
                args[0][0, 0, 0] += 1.0  # k [L, T, H * D]
        return result

    return impl


def make_entry(key: dict, config: dict) -> TuningEntry:
    return TuningEntry(key=key, config=config, median_us=1.0, candidates=3)


def write_file(directory: Path, op: str, dtype: str, entries: list[TuningEntry]) -> Path:
    tuning_file = TuningFile(op, "interpret", "cpu", dtype, entries)
    return tuning_lookup.save_tuning_file(tuning_file, directory)


# ---------------------------------------------------------------------------------------
# the pipeline: candidates are checked before they are timed, the fastest is written
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["paged_gather", "paged_scatter", "rope_rerotate"])
def test_a_candidate_with_wrong_results_is_rejected_and_never_timed(
    op: str, tuning_dir: Path
) -> None:
    if op == "rope_rerotate":
        bad, good, fast_invalid = RopeConfig(2, 4, 1), RopeConfig(1, 4, 2), RopeConfig(3, 4, 1)
        problem = RopeProblem(TINY, CPU, "interpret", impl=corrupting(op, bad))
    else:
        bad, good, fast_invalid = CopyConfig(2, 2, 1), CopyConfig(1, 2, 2), CopyConfig(3, 2, 1)
        problem = PagedCopyProblem(op, TINY, CPU, "interpret", impl=corrupting(op, bad))
    problem.candidates = [problem.heuristic, bad, good, fast_invalid]
    # The broken and the invalid candidates would be the fastest if they were timed.
    timer = fake_timer({bad: 1e-6, fast_invalid: 1e-6, good: 2e-6, problem.heuristic: 3e-6})
    lines: list[str] = []
    results, files = sweep.run_problems(
        [problem], device=CPU, backend="interpret", timer=timer, progress=lines.append
    )

    (result,) = results
    assert [config for config, _ in result.timed] == [problem.heuristic, good]
    rejected = dict(result.rejected)
    assert "differ from the torch reference" in rejected[bad] or "beyond tolerance" in rejected[bad]
    assert "power of two" in rejected[fast_invalid]
    assert result.best == good and result.best_s == 2e-6 and result.heuristic_s == 3e-6
    assert sum("REJECTED" in line for line in lines) == 2 and len(lines) == 4
    assert lines[0].startswith("[1/4] ")

    (tuning_file,) = files
    (entry,) = tuning_file.entries
    assert entry.config == dataclasses.asdict(good)
    assert (entry.candidates, entry.rejected) == (2, 2)
    assert entry.median_us == 2.0 and entry.heuristic_us == 3.0
    assert entry.gbps == pytest.approx(problem.bytes_moved / 2e-6 / 1e9, rel=1e-3)


def test_tune_writes_one_file_per_op_that_round_trips_and_is_used(tuning_dir: Path) -> None:
    shape = dataclasses.replace(TINY, chunk_size=8)
    report = sweep.tune(
        shape,
        device=CPU,
        backend="interpret",
        timer=fake_timer({}),
        out_dir=tuning_dir,
        quick=True,
        copy_engine_max_bytes=128,
    )
    names = sorted(p.name for p in report.written)
    assert names == [
        "op=paged_gather,backend=interpret,device=cpu,dtype=int64.json",
        "op=paged_scatter,backend=interpret,device=cpu,dtype=int64.json",
        "op=rope_rerotate,backend=interpret,device=cpu,dtype=bfloat16.json",
    ]
    assert all(p.parent == tuning_dir for p in report.written)

    for path, written in zip(report.written, report.files, strict=True):
        data = json.loads(path.read_text())
        assert data["kvtier_tuning"] == tuning_files.SCHEMA_VERSION
        assert (data["backend"], data["device"]) == ("interpret", "cpu")
        assert {"torch", "triton"} <= set(data["versions"])
        (entry,) = data["entries"]
        assert set(entry["key"]) == set(tuning_files.TUNABLES[data["op"]].shape_fields)
        assert set(entry["config"]) == set(tuning_files.TUNABLES[data["op"]].config_fields)
        assert entry["candidates"] >= 1 and entry["rejected"] == 0
        loaded = tuning_files.load_tuning_file(path)
        assert loaded.to_json() == written.to_json() == data  # round trip
        if data["op"] == "rope_rerotate":
            assert data["copy_engine"] is None
        else:
            figures = data["copy_engine"]
            assert figures["direction"] == (
                "device_to_host" if data["op"] == "paged_gather" else "host_to_device"
            )
            assert [p["bytes"] for p in figures["points"]] == [64, 128]  # 1 and 2 blocks
            assert figures["crossover_bytes"] is None  # the fake timer: a tie is no win

    # The launchers now read these files (the user directory is first on the search path).
    gather_entry = report.files[0].entries[0]
    assert paged_copy.launch_config("paged_gather", 2, torch.int64, CPU) == CopyConfig(
        **gather_entry.config
    )


def test_every_generated_candidate_is_valid() -> None:
    for row_words, word_bytes in ((2, 8), (40, 8), (256, 8), (288, 8), (80, 2)):
        configs = paged_copy_candidates(row_words, word_bytes, 256)
        quick = paged_copy_candidates(row_words, word_bytes, 256, quick=True)
        assert configs and set(quick) <= set(configs) and len(set(configs)) == len(configs)
        for c in configs:
            check_launch_config(c, ("block_tokens", "block_row"))
            assert c.block_tokens * c.block_row * word_bytes <= 32768, c
            assert c.block_row <= 2 * row_words and c.block_tokens <= 64, c
    for half, tokens in ((4, 4), (32, 256), (40, 256), (64, 17)):
        configs = rope_candidates(half, tokens)
        assert configs
        for c in configs:
            check_launch_config(c, ("block_tokens", "block_pairs"))
            assert c.block_pairs <= 2 * half and c.block_tokens <= 2 * tokens, c
    for op in ("paged_gather", "paged_scatter"):
        problem = PagedCopyProblem(op, TINY, CPU, "interpret")
        assert problem.heuristic in problem.candidates
        assert problem.key == {"row_words": 2} and problem.dtype == torch.int64
    problem = RopeProblem(TINY, CPU, "interpret")
    assert problem.heuristic in problem.candidates
    assert problem.key == {"half_rotary": 4, "num_tokens": 4}


def test_build_problems_skips_rope_where_it_does_not_apply() -> None:
    mla = ModelShape(num_layers=2, num_kv_heads=1, head_size=576, layout="mla", rotary_dim=0)
    problems, notes = sweep.build_problems(mla, device=CPU, backend="interpret")
    assert [p.op for p in problems] == ["paged_gather", "paged_scatter"]
    assert notes == ["rope_rerotate skipped: the model has no rotary dims to re-rotate"]
    fp8 = dataclasses.replace(TINY, dtype=torch.float8_e4m3fn)
    problems, notes = sweep.build_problems(fp8, device=CPU, backend="interpret")
    assert [p.op for p in problems] == ["paged_gather", "paged_scatter"]
    assert problems[0].dtype == torch.int64  # 8 fp8 values per row: one int64 word
    assert "float8_e4m3fn" in notes[0]
    with pytest.raises(ValueError, match="not tunable"):
        sweep.build_problems(TINY, device=CPU, backend="interpret", ops=["paged_copy"])


def test_rope_is_not_tuned_for_a_latent_layout_given_by_flags() -> None:
    """kvtier never re-rotates MLA's latent KV, whether a model config or --layout says MLA."""
    mla = ModelShape(num_layers=2, num_kv_heads=1, head_size=16, layout="mla")
    problems, notes = sweep.build_problems(mla, device=CPU, backend="interpret")
    assert [p.op for p in problems] == ["paged_gather", "paged_scatter"]
    assert notes == ["rope_rerotate skipped: layout 'mla' holds latent KV, never re-rotated"]


def test_an_op_named_twice_is_tuned_once() -> None:
    """Tuned twice, its file would hold two entries of one key: ignored by every launcher."""
    ops = ["paged_gather", "rope_rerotate", "paged_gather"]
    problems, _ = sweep.build_problems(TINY, device=CPU, backend="interpret", ops=ops)
    assert [p.op for p in problems] == ["paged_gather", "rope_rerotate"]


# ---------------------------------------------------------------------------------------
# lookup: tuned configs win where a file matches, the heuristics everywhere else
# ---------------------------------------------------------------------------------------


def test_launchers_launch_with_the_tuned_config(
    tuning_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    heuristic = paged_copy.launch_config("paged_gather", 2, torch.int64, CPU)
    tuned = CopyConfig(1, 2, 4)
    assert tuned != heuristic
    write_file(
        tuning_dir,
        "paged_gather",
        "int64",
        [make_entry({"row_words": 2}, dataclasses.asdict(tuned))],
    )
    assert paged_copy.launch_config("paged_gather", 2, torch.int64, CPU) == tuned
    # re-tuning compares against the built-in heuristic, not the file in effect
    problem = PagedCopyProblem("paged_gather", TINY, CPU, "interpret")
    assert problem.heuristic == dataclasses.replace(heuristic, block_tokens=4)  # 4 tokens
    # other rows, word types, ops and devices keep the heuristics
    assert paged_copy.launch_config("paged_gather", 4, torch.int64, CPU) == (
        paged_copy.launch_config("paged_scatter", 4, torch.int64, CPU)
    )
    assert paged_copy.launch_config("paged_scatter", 2, torch.int64, CPU) == heuristic
    assert paged_copy.launch_config("paged_gather", 4, torch.int32, CPU).block_row == 4
    assert paged_copy.launch_config("paged_gather", 2, torch.int64, torch.device("cuda")) != tuned
    assert not torch.cuda.is_initialized()

    launches = []
    real_kernel = paged_copy.KERNEL

    class RecordingKernel:
        def get(self, interpret):
            kernel = real_kernel.get(interpret)

            class Recorder:
                def __getitem__(self, grid):
                    def launch(*args, **meta):
                        launches.append((grid, meta))
                        return kernel[grid](*args, **meta)

                    return launch

            return Recorder()

    monkeypatch.setattr(paged_copy, "KERNEL", RecordingKernel())
    paged = PagedKV.empty(
        "vllm_nhd", num_layers=2, num_blocks=4, block_size=2, num_heads=1, head_size=8
    )
    for t in paged.tensors:
        fill_random_(t, torch.Generator().manual_seed(0))
    slots = torch.tensor([3, -1, 0, 6])
    out = torch.zeros(paged.chunk_shape(4), dtype=paged.dtype)
    expected = paged_copy.gather_reference(paged, slots, out.clone())
    paged_copy.gather(paged, slots, out, backend="interpret")
    assert_chunk_equal(out, expected, paged, slots, range(2))
    (grid, meta), *_ = launches
    assert (meta["BLOCK_T"], meta["BLOCK_R"], meta["num_warps"]) == (1, 2, 4)
    assert grid == (4, 2, 2)  # 4 token tiles of one token, 2 layers, K and V


def test_rope_uses_the_entry_for_the_closest_token_count(tuning_dir: Path) -> None:
    entries = [
        make_entry(
            {"half_rotary": 32, "num_tokens": 16},
            {"block_tokens": 16, "block_pairs": 32, "num_warps": 2},
        ),
        make_entry(
            {"half_rotary": 32, "num_tokens": 256},
            {"block_tokens": 64, "block_pairs": 16, "num_warps": 8},
        ),
    ]
    write_file(tuning_dir, "rope_rerotate", "bfloat16", entries)
    launch_config = functools.partial(rerotation.launch_config, dtype=torch.bfloat16, device=CPU)
    assert launch_config(32, 256) == RopeConfig(64, 16, 8)
    assert launch_config(32, 512) == RopeConfig(64, 16, 8)
    assert launch_config(32, 100) == RopeConfig(64, 16, 8)  # log2: 100 is closer to 256
    assert launch_config(32, 40) == RopeConfig(16, 32, 2)
    assert launch_config(32, 5) == RopeConfig(8, 32, 2)  # BLOCK_T capped at the tokens
    heuristic = rerotation.launch_config(64, 256, torch.bfloat16, CPU)
    assert heuristic.block_pairs == 64  # half_rotary 64: no entry
    assert rerotation.launch_config(32, 256, torch.float16, CPU) != RopeConfig(64, 16, 8)


def _valid_document() -> dict:
    return TuningFile(
        "paged_gather",
        "interpret",
        "cpu",
        "int64",
        [make_entry({"row_words": 2}, {"block_tokens": 1, "block_row": 2, "num_warps": 4})],
    ).to_json()


def _broken(change) -> str:
    document = _valid_document()
    change(document)
    return json.dumps(document)


BAD_FILES = {
    "not json": "{ this is not json",
    "not an object": "[1, 2]",
    "other schema version": _broken(lambda d: d.update(kvtier_tuning=99)),
    "another device": _broken(lambda d: d.update(device="NVIDIA H100 80GB HBM3")),
    "another op": _broken(lambda d: d.update(op="paged_scatter")),
    "num_warps 3": _broken(lambda d: d["entries"][0]["config"].update(num_warps=3)),
    "block_row 6": _broken(lambda d: d["entries"][0]["config"].update(block_row=6)),
    "missing field": _broken(lambda d: d["entries"][0]["config"].pop("block_row")),
    "rope key": _broken(lambda d: d["entries"][0].update(key={"half_rotary": 2})),
    "duplicate key": _broken(lambda d: d["entries"].append(d["entries"][0])),
    "bad crossover": _broken(lambda d: d.update(copy_engine={"crossover_bytes": -1})),
}


@pytest.mark.parametrize("content", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_an_unusable_file_is_ignored_with_a_warning(content: str, tuning_dir: Path) -> None:
    tuning_dir.mkdir()
    path = tuning_dir / tuning_files.file_name("paged_gather", "interpret", "cpu", "int64")
    path.write_text(content)
    heuristic = paged_copy.launch_config("paged_scatter", 2, torch.int64, CPU)
    with pytest.warns(RuntimeWarning, match=r"ignoring tuning file .*int64\.json: .*heuristics"):
        assert paged_copy.launch_config("paged_gather", 2, torch.int64, CPU) == heuristic
    # the launch itself goes on
    paged = PagedKV.empty(
        "vllm_nhd", num_layers=1, num_blocks=2, block_size=2, num_heads=1, head_size=8
    )
    out = torch.empty(paged.chunk_shape(2), dtype=paged.dtype)
    paged_copy.gather(paged, torch.tensor([0, 3]), out, backend="interpret")
    (status,) = tuning_lookup.files_in_effect("paged_gather", "interpret", "cpu")
    assert status.status == "ignored" and status.path == path


def test_the_first_usable_file_on_the_search_path_wins(tmp_path: Path) -> None:
    first, second, third = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    first.mkdir()
    name = tuning_files.file_name("paged_gather", "interpret", "cpu", "int64")
    (first / name).write_text("corrupt")
    for directory, warps in ((second, 2), (third, 8)):
        config = {"block_tokens": 1, "block_row": 2, "num_warps": warps}
        write_file(directory, "paged_gather", "int64", [make_entry({"row_words": 2}, config)])
    try:
        tuning_lookup.set_search_path([first, second, third])
        with pytest.warns(RuntimeWarning, match="ignoring tuning file"):
            assert paged_copy.launch_config("paged_gather", 2, torch.int64, CPU).num_warps == 2
        statuses = [
            s.status for s in tuning_lookup.files_in_effect("paged_gather", "interpret", "cpu")
        ]
        assert statuses == ["ignored", "in effect", "shadowed"]
    finally:
        tuning_lookup.set_search_path(None)


def test_saving_merges_entries_of_other_shapes(tuning_dir: Path) -> None:
    def config(warps: int) -> dict:
        return {"block_tokens": 1, "block_row": 2, "num_warps": warps}

    write_file(tuning_dir, "paged_gather", "int64", [make_entry({"row_words": 2}, config(1))])
    write_file(tuning_dir, "paged_gather", "int64", [make_entry({"row_words": 4}, config(2))])
    path = write_file(
        tuning_dir, "paged_gather", "int64", [make_entry({"row_words": 2}, config(4))]
    )
    entries = tuning_files.load_tuning_file(path).entries
    assert [(e.key["row_words"], e.config["num_warps"]) for e in entries] == [(2, 4), (4, 2)]
    assert [p.name for p in tuning_dir.iterdir()] == [path.name]  # no temporary files left


def test_default_search_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(tuning_lookup.TUNING_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning_lookup.search_path() == (
        tmp_path / "kvtier" / "tuning",
        tuning_lookup.PACKAGED_DIR,
    )
    monkeypatch.setenv(tuning_lookup.TUNING_DIR_ENV, os.pathsep.join(["/x", "/y"]))
    assert tuning_lookup.search_path() == (Path("/x"), Path("/y"), tuning_lookup.PACKAGED_DIR)
    monkeypatch.setenv(tuning_lookup.TUNING_DIR_ENV, os.pathsep)  # names no directory
    assert tuning_lookup.user_dirs() == (tmp_path / "kvtier" / "tuning",)


# ---------------------------------------------------------------------------------------
# model shapes and the copy-engine crossover
# ---------------------------------------------------------------------------------------


def test_model_config_files(tmp_path: Path) -> None:
    llama = {
        "model_type": "llama",
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(llama))
    shape = model_shape_from_config(tmp_path, chunk_size=128)  # a model directory
    assert (shape.num_layers, shape.num_kv_heads, shape.head_size, shape.rope_dim) == (
        32,
        8,
        128,
        128,
    )
    assert shape.dtype == torch.bfloat16 and shape.chunk_size == 128 and shape.layout == "vllm_nhd"
    phi = {
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
        "hidden_size": 2560,
        "partial_rotary_factor": 0.4,
        "dtype": "float16",
    }
    shape = model_shape_from_config(phi)
    assert (shape.num_kv_heads, shape.head_size, shape.rope_dim, shape.dtype) == (
        32,
        80,
        32,
        torch.float16,
    )
    gemma = {
        "text_config": {
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "hidden_size": 2560,
        }
    }
    shape = model_shape_from_config(gemma, dtype=torch.float32)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_size) == (4, 4, 256)
    deepseek = {
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "torch_dtype": "bfloat16",
    }
    shape = model_shape_from_config(deepseek)
    assert (shape.layout, shape.num_kv_heads, shape.head_size, shape.rope_dim) == ("mla", 1, 576, 0)
    with pytest.raises(ValueError, match="no num_hidden_layers"):
        model_shape_from_config({"num_attention_heads": 2})
    with pytest.raises(ValueError, match="cannot read model config"):
        model_shape_from_config(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="rotary_dim must be an even number"):
        model_shape_from_config(llama, rotary_dim=130)


def test_find_crossover() -> None:
    def points(*pairs):
        return [{"bytes": 1 << i, "kernel_us": k, "copy_us": c} for i, (k, c) in enumerate(pairs)]

    assert find_crossover(points((1, 5), (2, 4), (8, 6), (16, 9))) == 4
    assert find_crossover(points((1, 5), (9, 4), (3, 6), (16, 9))) == 8  # must stay won
    assert find_crossover(points((1, 5), (2, 4))) is None
    assert find_crossover(points((9, 5), (9, 4))) == 1
    assert find_crossover([]) is None


def test_copy_engine_measurement_times_both_paths(tuning_dir: Path) -> None:
    calls = []

    def timer(fn, warmup, repeats):
        """The kernel takes 2 us; copy_ 3 us device to host (the first 6 calls), 1 us back."""
        calls.append(fn.__name__)
        fn()
        if fn.__name__ == "kernel":
            return [2e-6]
        return [3e-6 if len(calls) <= 6 else 1e-6]

    figures = measure_copy_engine(TINY, device=CPU, backend="interpret", timer=timer, max_bytes=256)
    assert calls == ["kernel", "copy"] * 6  # 1, 2, 4 blocks of 64 B; both directions
    gather, scatter = figures["paged_gather"], figures["paged_scatter"]
    assert [p["bytes"] for p in gather.points] == [64, 128, 256]
    assert gather.crossover_bytes is None  # the kernel won at every size
    assert scatter.crossover_bytes == 64  # copy_ won from the smallest size on
    assert scatter.points[0] == {"bytes": 64, "kernel_us": 2.0, "copy_us": 1.0}
    assert gather.shape["layout"] == "vllm_nhd" and gather.shape["block_bytes"] == 64


# ---------------------------------------------------------------------------------------
# the commands
# ---------------------------------------------------------------------------------------


def test_kvtier_kernels_lists_ops_backends_and_tuning_files(tmp_path: Path) -> None:
    directory = tmp_path / "tuning"
    config = {"block_tokens": 1, "block_row": 2, "num_warps": 4}
    good = write_file(directory, "paged_gather", "int64", [make_entry({"row_words": 2}, config)])
    bad = directory / tuning_files.file_name("rope_rerotate", "interpret", "cpu", "float16")
    bad.write_text("{")
    env = {**os.environ, tuning_lookup.TUNING_DIR_ENV: str(directory)}
    out = subprocess.run(
        [KVTIER, "kernels"], capture_output=True, text=True, check=True, env=env, timeout=120
    ).stdout
    assert "torch      available" in out and "interpret  available" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    # compiled Triton is listed only where torch sees a GPU
    gpu = torch.cuda.is_available()
    backends = "torch, triton, interpret" if gpu else "torch, interpret"
    numba = importlib.util.find_spec("numba") is not None
    for op in ("paged_gather", "paged_scatter", "rope_rerotate"):
        assert backends in lines[op], lines[op]
        listed, auto = lines[op].split(backends, 1)[1].split()[:2]
        if numba and not gpu:  # the paged copies and RoPE have numba CPU kernels
            assert (listed, auto) == (",", "numba"), lines[op]  # "..., numba  numba"
        else:
            assert listed == ("triton" if gpu else "torch"), lines[op]
    assert "built-in heuristics" in lines["paged_scatter"]
    assert f"in effect: int64: {good} (1 shape)" in out
    assert f"ignored: float16: {bad} (cannot read it" in out
    assert f"{directory}  [{tuning_lookup.TUNING_DIR_ENV}]" in out

    report = json.loads(
        subprocess.run(
            [KVTIER, "kernels", "--json"], capture_output=True, text=True, check=True, env=env
        ).stdout
    )
    assert report["tuning_search_path"][0] == {
        "path": str(directory),
        "kind": tuning_lookup.TUNING_DIR_ENV,
        "exists": True,
    }
    gather = report["ops"]["paged_gather"]
    assert gather["tuning_files"] == [
        {"dtype": "int64", "path": str(good), "status": "in effect", "detail": "1 shape"}
    ]
    assert report["ops"]["rope_rerotate"]["tuning_files"][0]["status"] == "ignored"
    assert report["ops"]["paged_scatter"]["tuning_files"] == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_kvtier_tune_refuses_without_a_gpu(tmp_path: Path) -> None:
    env = {**os.environ, tuning_lookup.TUNING_DIR_ENV: str(tmp_path)}
    proc = subprocess.run(
        [KVTIER, "tune", "--layers", "2", "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "needs a CUDA or ROCm GPU" in proc.stderr
    assert "interpreter" in proc.stderr and "nothing was tuned" in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--layers", "0"], "num_layers"),
        (["--dtype", "int7"], "int7"),
        (["--ops", "paged_copy"], "--ops"),
        (["--repeats", "0"], "--repeats 0"),
        (["--warmup", "-1"], "--warmup -1"),
        (["--out", "/dev/null/tuning"], "--out '/dev/null/tuning': /dev/null is not a directory"),
        (["--out", ""], "--out is empty"),
        (["--out", " "], "--out is empty"),
    ],
)
def test_kvtier_tune_names_a_bad_argument_on_any_machine(
    argv: list[str], named: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["tune", *argv]) == 2
    err = capsys.readouterr().err
    assert named in err and "GPU" not in err, err


def test_kvtier_tune_pipeline_on_the_interpreter(
    tuning_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The command end to end, with its GPU target swapped for the interpreter (a test
    seam, not a flag): shape from a model config with overrides, files written."""
    import kvtier.commands.tune

    monkeypatch.setattr(
        kvtier.commands.tune, "_tuning_target", lambda requested: (CPU, "interpret", fake_timer({}))
    )
    config = tuning_dir.parent / "config.json"
    config.write_text(
        json.dumps(
            {
                "num_hidden_layers": 2,
                "num_attention_heads": 1,
                "hidden_size": 8,
                "torch_dtype": "float32",
            }
        )
    )
    argv = [
        "tune",
        "--model-config",
        str(config),
        "--dtype",
        "bf16",
        "--block-size",
        "2",
        "--chunk-size",
        "4",
        "--quick",
        "--copy-engine-max-mib",
        "0",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "shape: 2 layers x 1 KV heads x 8, bfloat16, block 2, chunk 4" in captured.out
    assert "[1/" in captured.err
    assert "copy engine, paged_gather (device_to_host)" in captured.out
    assert sorted(p.name.split(",")[0] for p in tuning_dir.iterdir()) == [
        "op=paged_gather",
        "op=paged_scatter",
        "op=rope_rerotate",
    ]
    assert main([*argv, "--ops", "paged_copy"]) == 2
    assert "unknown ['paged_copy']" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize(
    "target", [("cuda", 90, 32), ("hip", "gfx942", 64)], ids=["sm90", "gfx942"]
)
@pytest.mark.parametrize("op", ["paged_gather", "rope_rerotate"])
def test_the_extreme_candidates_compile_for_gpu_targets(op: str, target: tuple) -> None:
    """The largest tile at the most warps and the smallest at one warp lower to cubin /
    hsaco (what a sweep on a GPU compiles; no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget

    if op == "paged_gather":
        kernel, fn = paged_copy.KERNEL.get(interpret=False), paged_copy.paged_copy_kernel
        pointers = {"layer_bases": "*i64", "slot_mapping": "*i64", "chunk": "*i64"}
        candidates = paged_copy_candidates(256, 8, 256)  # Llama-3-8B, bf16
        tile = {"BLOCK_T": "block_tokens", "BLOCK_R": "block_row"}
    else:
        kernel, fn = rerotation.KERNEL.get(interpret=False), rerotation.rerotate_kernel
        pointers = {"k": "*bf16", "old_positions": "*i64", "new_positions": "*i64"}
        pointers["inv_freq"] = "*fp32"
        candidates = rope_candidates(64, 256)
        tile = {"BLOCK_T": "block_tokens", "BLOCK_P": "block_pairs"}
    params = list(inspect.signature(fn).parameters)
    constexprs = [p for p in params if p.isupper()]
    signature = dict.fromkeys(params, "i64") | pointers | dict.fromkeys(constexprs, "constexpr")

    def size(config) -> tuple[int, int]:
        return math.prod(getattr(config, f) for f in tile.values()), config.num_warps

    for config in (max(candidates, key=size), min(candidates, key=size)):
        values = {
            name: getattr(config, tile[name]) if name in tile else True for name in constexprs
        }
        source = triton.compiler.ASTSource(kernel, signature, values)  # IS_NEOX=True
        try:
            compiled = triton.compile(
                source, target=GPUTarget(*target), options={"num_warps": config.num_warps}
            )
        except RuntimeError as error:  # pragma: no cover - a triton build without this backend
            pytest.skip(f"triton cannot lower for {target}: {error}")
        assert compiled.metadata.num_warps == config.num_warps
        assert compiled.asm["cubin" if target[0] == "cuda" else "hsaco"]


def test_each_tunable_op_declares_itself_and_has_a_sweep_entry() -> None:
    for name in sweep.__all__:
        assert hasattr(sweep, name), name
    # the op files declare their tunables at import; the sweep has one entry for each
    assert sorted(tuning_files.TUNABLES) == ["paged_gather", "paged_scatter", "rope_rerotate"]
    assert set(sweep.SWEEPS) == set(tuning_files.TUNABLES)


def test_prepend_search_path(tuning_dir: Path, tmp_path: Path) -> None:
    first = tmp_path / "first"
    try:
        tuning_lookup.prepend_search_path([first])
        assert tuning_lookup.search_path()[:2] == (first, tuning_dir)
        tuning_lookup.prepend_search_path([first])  # idempotent
        assert tuning_lookup.search_path().count(first) == 1
        tuning_lookup.prepend_search_path([tuning_dir])  # moves to the front, no duplicate
        assert tuning_lookup.search_path()[:2] == (tuning_dir, first)
    finally:
        tuning_lookup.set_search_path(None)


def test_importing_the_tuning_code_stays_light() -> None:
    code = (
        "import sys, torch, kvtier.cli, kvtier_kernels.tuning.sweep\n"
        "from kvtier_kernels.paged import copy as paged_copy\n"
        "from kvtier_kernels.rope import rerotation\n"
        "from kvtier_kernels.tuning import lookup as tuning_lookup\n"
        "paged_copy.launch_config('paged_gather', 256, torch.int64, torch.device('cuda'))\n"
        "rerotation.launch_config(64, 256, torch.bfloat16, torch.device('cpu'))\n"
        "tuning_lookup.search_path()\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('triton', 'vllm'))\n"
        "assert not bad, bad\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_tuning_files_are_keyed_by_the_amd_architecture(monkeypatch):
    """On ROCm the key is the architecture, not a marketing name that varies by driver."""
    from types import SimpleNamespace

    from kvtier_kernels.tuning import files as tuning_files

    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    props = SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "AMD Radeon Graphics")
    tuning_files.gpu_name.cache_clear()  # one answer per process and device, cached
    assert tuning_files.gpu_name(0) == "gfx942"
    monkeypatch.setattr(torch.version, "hip", None)
    tuning_files.gpu_name.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    assert tuning_files.gpu_name(0) == "NVIDIA H100 80GB HBM3"
    tuning_files.gpu_name.cache_clear()


@pytest.mark.parametrize("device", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_the_packaged_rope_tunings_are_shipped_valid_and_found(monkeypatch, device):
    """The RoPE tunings of the H200 (1.5x its heuristic) and H100 (1.24x) runs ship as
    packaged defaults: each loads and checks, and on its GPU ``kvtier info`` / ``kvtier
    kernels`` list it in effect (gather/scatter tuned to their heuristic there, so none
    ships for them)."""
    import kvtier.machine
    from kvtier_kernels.tuning import files as tuning_files

    shipped = sorted(p.name for p in tuning_lookup.PACKAGED_DIR.glob("*.json"))
    assert shipped == [
        "op=rope_rerotate,backend=triton,device=NVIDIA_H100_80GB_HBM3,dtype=bfloat16.json",
        "op=rope_rerotate,backend=triton,device=NVIDIA_H200,dtype=bfloat16.json",
    ]
    for name in shipped:
        loaded = tuning_files.load_tuning_file(tuning_lookup.PACKAGED_DIR / name)
        assert loaded.op == "rope_rerotate" and loaded.entries
    monkeypatch.delenv(tuning_lookup.TUNING_DIR_ENV, raising=False)
    monkeypatch.setenv("HOME", "/nonexistent-home")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tuning_files, "device_name", lambda _: device)
    rows = kvtier.machine.tuning_in_effect()
    assert [(r["op"], r["backend"], r["dtype"]) for r in rows] == [
        ("rope_rerotate", "triton", "bfloat16")
    ]
    packaged = [r for r in kvtier.machine.search_path_rows() if r["kind"] == "packaged defaults"]
    assert packaged and packaged[0]["exists"]
