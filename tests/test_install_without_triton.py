"""kvtier installed where Triton is not: imports, `kvtier info`, the cache engine and the
vLLM connector run on the torch reference kernels.

GPU builds of torch bring their vendor's Triton and kvtier must not overwrite it, so Triton
is an extra (``kvtier[triton]``), not a requirement. The environment here is a fresh venv
that sees every package of the test venv except Triton (a directory of links on a ``.pth``
path), into which ``pip install`` puts kvtier from this checkout, as a user would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def venv_without_triton(tmp_path_factory) -> Path:
    """The python of a venv with kvtier installed and no Triton importable."""
    tmp = tmp_path_factory.mktemp("no-triton")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")], check=True)
    python = tmp / "venv" / "bin" / "python"
    farm = tmp / "site"
    farm.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        name = entry.name
        if name == "triton" or name.startswith(("triton-", "kvtier", "__editable__")):
            continue
        if name.endswith(".pth"):
            continue
        (farm / name).symlink_to(entry)
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "test-packages.pth").write_text(f"{farm}\n")
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-build-isolation", str(ROOT)],
        capture_output=True,
        text=True,
        cwd=tmp,
    )
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    return python


def _run(python: Path, program: str, timeout: float = 300) -> str:
    proc = subprocess.run(
        [str(python), "-c", textwrap.dedent(program)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=python.parent,  # not the checkout: kvtier must come from the install
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},  # nor from a path
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_kvtier_imports_and_info_reports_the_torch_backend_only(venv_without_triton):
    out = _run(
        venv_without_triton,
        """
        import importlib.util, json, sys
        assert importlib.util.find_spec("triton") is None
        import kvtier, kvtier_kernels
        assert "site-packages" in kvtier.__file__, kvtier.__file__
        from kvtier.cli import main
        sys.exit(main(["info", "--json"]))
        """,
    )
    info = json.loads(out)
    assert info["versions"]["triton"] == "not installed"
    assert info["kernel_backends"]["triton"] == "triton not installed"
    # torch everywhere (numba, where it imports, for CacheGen's rANS and RoPE); no Triton
    assert info["kernel_ops"]
    for op, backends in info["kernel_ops"].items():
        assert backends[0] == "torch" and not {"triton", "interpret"} & set(backends), op


def test_the_cache_engine_stores_and_loads_bit_exactly(venv_without_triton):
    out = _run(
        venv_without_triton,
        """
        import torch
        from kvtier.config import load_config
        from kvtier.engine import CacheEngine, EngineMetadata
        from kvtier_kernels import PagedKV

        paged = PagedKV.empty("vllm_cpu", num_layers=2, num_blocks=64, block_size=32,
                              num_heads=2, head_size=64, dtype=torch.bfloat16)
        for t in paged.tensors:
            t.view(torch.int16).random_(-(2**15), 2**15)
        config = load_config({"max_local_cpu_size": 0.05, "chunk_size": 64}, env={})
        engine = CacheEngine(config, EngineMetadata("m"), paged)
        assert engine.paged_io.backend in ("auto", "torch")
        tokens = torch.arange(256)
        engine.store(tokens, slot_mapping=torch.arange(256))
        loaded = engine.retrieve(tokens, slot_mapping=torch.arange(1024, 1280))
        for t in paged.tensors:
            assert torch.equal(t[:8].view(torch.int16), t[32:40].view(torch.int16))
        print(loaded)
        """,
    )
    assert out.split()[-1] == "256"


@pytest.mark.vllm
def test_the_vllm_connector_serves_hits(venv_without_triton, model_a):
    out = _run(
        venv_without_triton,
        f"""
        import json, sys
        sys.path.insert(0, {str(TESTS)!r})
        from support.engines import expected_loaded, generate, make_llm, prompts_of, shutdown
        if __name__ == "__main__":
            prompts = prompts_of([300], seed=11)
            llm = make_llm({str(model_a)!r}, kvtier={{"chunk_size": 64}})
            cold = generate(llm, prompts)
            llm.reset_prefix_cache()
            warm = generate(llm, prompts)
            shutdown(llm)
            print(json.dumps([cold[0].token_ids, warm[0].token_ids, warm[0].num_cached_tokens]))
        """,
        timeout=600,
    )
    cold, warm, loaded = json.loads(out.strip().splitlines()[-1])
    assert loaded == 256 and warm == cold
