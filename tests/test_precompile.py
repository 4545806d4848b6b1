"""``kvtier precompile`` and the connector's ``precompile_kernels``: the warm-up plan covers
every token count an engine may launch, moves no KV, compiles without launching when asked
(never launching in that mode), and says clearly when there is nothing to compile.

Without a GPU the plan runs under Triton's interpreter (tiny shapes); compile-only mode is
checked against a stand-in kernel that records Triton ``warmup`` calls.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import threading

import pytest
import torch

from kvtier.cli import main
from kvtier.config import load_config
from kvtier.engine import CacheEngine, EngineMetadata
from kvtier.warmup import engine_ops, nothing_to_compile, numba_ops, start_background
from kvtier_kernels import PagedKV, gather, registry
from kvtier_kernels._launch import compile_only
from kvtier_kernels.paged import copy as paged_copy
from kvtier_kernels.precompile import WARMABLE_OPS, plan_warmup, token_counts, warm_numba

pytest.importorskip("triton")


def small_cache(layout: str = "vllm_nhd", dtype=torch.bfloat16) -> PagedKV:
    paged = PagedKV.empty(
        layout, num_layers=2, num_blocks=4, block_size=4, num_heads=2, head_size=16, dtype=dtype
    )
    for t in paged.tensors:
        t.view(torch.int16 if dtype.itemsize == 2 else torch.int32).random_(-1000, 1000)
    return paged


def bits(paged: PagedKV) -> list[torch.Tensor]:
    return [t.view(torch.uint8).clone() for t in paged.tensors]


def test_token_counts_cover_every_partial_chunk() -> None:
    assert token_counts(4) == [4, 3, 2, 1]
    with pytest.raises(ValueError, match="chunk_size"):
        token_counts(0)


@pytest.mark.parametrize("layout", ["vllm_nhd", "flashinfer_hnd", "vllm_cpu"])
def test_the_plan_launches_every_token_count_and_moves_no_kv(layout: str) -> None:
    paged = small_cache(layout)
    before = bits(paged)
    plan = plan_warmup(paged, 4, backend="interpret", layerwise=True)
    # all layers, then one layer (layerwise), each of 4 token counts
    assert plan.describe() == {"paged_gather": 8, "paged_scatter": 8}
    report = plan.run()
    assert [(o.op, o.calls) for o in report.ops] == [("paged_gather", 8), ("paged_scatter", 8)]
    assert report.variants is None  # the interpreter compiles nothing
    for i, (was, now) in enumerate(zip(before, bits(paged), strict=True)):
        assert torch.equal(was, now), f"the warm-up wrote into layer tensor {i}"


def test_every_warmable_op_runs_in_both_modes() -> None:
    paged = small_cache()
    plan = plan_warmup(paged, 3, backend="interpret", ops=WARMABLE_OPS, rotary_dim=8)
    assert plan.describe() == {
        "paged_gather": 3,
        "paged_scatter": 3,
        "cachegen": 2,  # a whole chunk and a partial one
        "rope_rerotate": 3,
    }
    for compile_only_mode in (False, True):
        report = plan.run(compile_only=compile_only_mode)
        assert {o.op for o in report.ops} == set(WARMABLE_OPS)


def test_nothing_to_warm_is_said() -> None:
    paged = small_cache()
    with pytest.raises(ValueError, match="nothing to compile"):
        plan_warmup(paged, 4, backend="torch")
    with pytest.raises(ValueError, match="warmable ops"):
        plan_warmup(paged, 4, backend="interpret", ops=("paged_gather", "flash_attn"))
    # MLA has one latent plane: no codec, no RoPE
    mla = PagedKV.empty("mla", num_layers=1, num_blocks=2, block_size=4, num_heads=1, head_size=16)
    plan = plan_warmup(
        mla, 2, backend="interpret", ops=("paged_gather", "cachegen", "rope_rerotate")
    )
    assert plan.describe() == {"paged_gather": 2}


def test_compile_only_moves_nothing_and_names_the_kernel() -> None:
    paged = small_cache()
    out = torch.zeros(paged.chunk_shape(4), dtype=paged.dtype)
    with compile_only() as requested:
        gather(paged, torch.arange(4), out, backend="interpret")
    assert requested == [("paged_copy_kernel", None)]
    assert not out.view(torch.int16).any()
    gather(paged, torch.arange(4), out, backend="interpret")  # outside: launched
    assert out.view(torch.int16).any()


class RecordingKernel:
    """Stands in for a compiled ``JITFunction``: records ``warmup`` and launches."""

    def __init__(self) -> None:
        self.warmups: list[tuple] = []
        self.launches: list[tuple] = []

    def warmup(self, *args, grid, **meta):
        self.warmups.append((grid, args, meta))
        return f"compiled-{len(self.warmups)}"

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launches.append((grid, args, meta))


def test_compile_only_calls_tritons_warmup_in_this_thread_only(monkeypatch) -> None:
    fake = RecordingKernel()
    monkeypatch.setitem(paged_copy.KERNEL._decorated, False, fake)
    seen_elsewhere = []
    with compile_only() as requested:
        paged_copy.KERNEL.get(False)[(3, 2, 1)](1, 2, TO_CHUNK=True, num_warps=4)
        other = threading.Thread(target=lambda: seen_elsewhere.append(paged_copy.KERNEL.get(False)))
        other.start()
        other.join()
    assert fake.warmups == [((3, 2, 1), (1, 2), {"TO_CHUNK": True, "num_warps": 4})]
    assert fake.launches == []
    assert requested == [("paged_copy_kernel", "compiled-1")]
    assert seen_elsewhere == [fake]  # another thread launches as usual
    paged_copy.KERNEL.get(False)[(1,)](5)
    assert fake.launches == [((1,), (5,), {})]


def test_nothing_to_compile_without_a_gpu() -> None:
    cpu = torch.device("cpu")
    assert "torch kernels" in nothing_to_compile("auto", cpu)
    assert nothing_to_compile("interpret", cpu) is None
    if not torch.cuda.is_available():
        assert "torch sees no GPU" in nothing_to_compile("auto", torch.device("cuda"))


def test_the_command_says_there_is_nothing_to_compile_here(capsys, monkeypatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.delenv("KVTIER_KERNEL_BACKEND", raising=False)
    assert main(["precompile", "--model-config", "/nonexistent"]) == 2  # bad input first
    assert main(["precompile"]) == 0
    out = capsys.readouterr().out
    if registry.pick("paged_scatter", "auto", torch.device("cpu")) == "numba":
        assert "numba CPU kernels of paged_gather, paged_scatter ready" in out
        assert "no Triton kernel to compile on this machine: torch sees no GPU" in out
    else:
        assert "nothing to compile on this machine: torch sees no GPU" in out
    assert "TRITON_CACHE_DIR" in out


def test_the_command_runs_the_plan_for_a_model_config(tmp_path, capsys, monkeypatch) -> None:
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,'
        ' "hidden_size": 64, "torch_dtype": "float16"}'
    )
    monkeypatch.setenv("KVTIER_KERNEL_BACKEND", "interpret")
    monkeypatch.setenv("KVTIER_CHUNK_SIZE", "3")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    code = main(["precompile", "--model-config", str(tmp_path), "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "2 layers x 2 KV heads x 16, float16" in out
    assert f"Triton cache: {tmp_path / 'triton'}" in out
    assert re.search(r"paged_gather +3 launches", out) and re.search(
        r"paged_scatter +3 launches", out
    )
    assert main(["precompile", "--ops", "paged_gather,nope", "--device", "cpu"]) == 2


def test_engine_ops_follow_the_config() -> None:
    assert engine_ops(load_config({}, env={})) == ("paged_gather", "paged_scatter")
    cachegen = load_config({"remote_serde": "cachegen"}, env={})
    assert engine_ops(cachegen) == ("paged_gather", "paged_scatter", "cachegen")


def test_the_connector_key_compiles_in_a_background_thread(caplog) -> None:
    caplog.set_level(logging.INFO, logger="kvtier.warmup")
    paged = small_cache()
    before = bits(paged)
    off = load_config({"chunk_size": 4, "kernel_backend": "interpret"}, env={})
    assert off.precompile_kernels is False
    assert start_background(off, CacheEngine(off, EngineMetadata("m"), paged)) is None

    torch_kernels = {"chunk_size": 4, "precompile_kernels": True, "kernel_backend": "torch"}
    auto = load_config(torch_kernels, env={})
    assert start_background(auto, CacheEngine(auto, EngineMetadata("m"), paged)) is None
    assert "nothing to compile (" in caplog.text

    config = load_config(
        {"chunk_size": 4, "kernel_backend": "interpret"}, env={"KVTIER_PRECOMPILE_KERNELS": "1"}
    )
    thread = start_background(config, CacheEngine(config, EngineMetadata("m"), paged))
    assert thread is not None and thread.daemon
    thread.join(timeout=60)
    assert "kvtier precompile_kernels: paged_gather 4 calls" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(before, bits(paged), strict=True))


def test_info_names_the_tuning_files_in_effect_and_tritons_cache(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["triton_cache"] == str(tmp_path / "triton")
    assert isinstance(info["tuning_in_effect"], list)
    if not torch.cuda.is_available():
        assert all(
            backends != ["torch", "triton", "interpret"] for backends in info["kernel_ops"].values()
        )


has_numba = importlib.util.find_spec("numba") is not None
needs_numba = pytest.mark.skipif(not has_numba, reason="needs numba (kvtier[cpu-codec])")
# where numba's kernels are what runs: a CPU machine (with a GPU, the Triton kernels do)
needs_cpu_numba = pytest.mark.skipif(
    torch.cuda.is_available() or not has_numba, reason="a CPU machine with numba"
)


@needs_numba
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_numba_kernels_are_warmed_for_every_argument_type(dtype) -> None:
    from kvtier_kernels.rope import numba_kernels as rope_numba

    assert warm_numba(("cachegen", "rope_rerotate"), dtype) == ["cachegen", "rope_rerotate"]
    layouts = {sig[0].layout for sig in rope_numba.NUMBA_KERNEL.get().signatures}
    assert {"C", "A"} <= layouts  # a chunk's K plane and a strided view of one
    from kvtier_kernels.paged.numba_rows import NUMBA_KERNELS

    assert warm_numba(("paged_gather", "paged_scatter"), dtype) == ["paged_gather", "paged_scatter"]
    assert all(kernel.get().signatures for kernel in NUMBA_KERNELS.values())  # both compiled
    assert warm_numba(("flash_nhd",), dtype) == []  # not an op with numba kernels


@needs_cpu_numba
def test_the_command_warms_numba_kernels_on_a_cpu(capsys, monkeypatch) -> None:
    monkeypatch.delenv("KVTIER_KERNEL_BACKEND", raising=False)
    assert main(["precompile", "--ops", "rope_rerotate", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "numba CPU kernels of rope_rerotate ready" in out
    # what it compiled, then that no Triton kernel is compiled here: never "nothing"
    assert "no Triton kernel to compile on this machine" in out
    assert "nothing to compile" not in out


@needs_cpu_numba
def test_the_connector_key_warms_numba_kernels_in_a_background_thread(caplog) -> None:
    caplog.set_level(logging.INFO, logger="kvtier.warmup")
    config = load_config({"precompile_kernels": True, "remote_serde": "cachegen"}, env={})
    assert numba_ops(config) == ("paged_gather", "paged_scatter", "cachegen")
    paged = small_cache()
    thread = start_background(config, CacheEngine(config, EngineMetadata("m"), paged))
    assert thread is not None and thread.daemon
    thread.join(timeout=120)
    assert "numba kernels of paged_gather, paged_scatter, cachegen ready" in caplog.text


def test_an_unknown_op_is_refused_on_any_machine(capsys) -> None:
    assert main(["precompile", "--ops", "paged_gather,nope", "--device", "cpu"]) == 2
    assert "--ops: unknown ['nope']; warmable ops: " in capsys.readouterr().err
