"""Compiling kvtier's Triton kernels for GPU targets without a GPU, and reading the result.

``compile_for`` lowers a kernel with an explicit ``GPUTarget`` (cached per kernel, target
and specialization); ``machine_code``, ``global_accesses`` and ``spill_count`` read the PTX
or AMDGCN it produced. Used by ``tests/test_gpu_compile.py`` (``make gpu-check``) and the
op modules' compile tests.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import pytest

# name -> (backend, arch, warp size)
TARGETS = {
    "sm80": ("cuda", 80, 32),
    "sm90": ("cuda", 90, 32),
    "gfx90a": ("hip", "gfx90a", 64),
    "gfx942": ("hip", "gfx942", 64),
    "gfx1100": ("hip", "gfx1100", 32),
}
# 128 bits per access: NVIDIA v2.b64 / v4.b32; AMD dwordx4 (CDNA) or b128 (RDNA).
WIDE_LOAD = re.compile(
    r"ld\.global(?:\.\w+)*\.v(?:2\.b64|4\.b32)|(?:global|buffer)_load_(?:dwordx4|b128)"
)
WIDE_STORE = re.compile(
    r"st\.global(?:\.\w+)*\.v(?:2\.b64|4\.b32)|(?:global|buffer)_store_(?:dwordx4|b128)"
)
_ACCESS = re.compile(r"\b(ld\.global[\w.]*|st\.global[\w.]*|(?:global|buffer)_(?:load|store)_\w+)")


def compile_for(
    kernel, signature: dict, constants: dict, target: str, divisible=(), num_warps: int = 4
):
    """``kernel`` compiled for ``target`` (a key of ``TARGETS``) on ``num_warps`` warps;
    ``divisible`` names the arguments Triton's launcher would mark divisible by 16. Skips
    the test when this Triton cannot lower for the target."""
    return _compile(
        kernel,
        tuple(signature.items()),
        tuple(constants.items()),
        target,
        tuple(divisible),
        num_warps,
    )


@functools.cache
def _compile(kernel, signature, constants, target, divisible, num_warps):
    import triton
    from triton.backends.compiler import GPUTarget

    names = [name for name, _ in signature]
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    source = triton.compiler.ASTSource(kernel, dict(signature), dict(constants), attrs)
    try:
        return triton.compile(
            source, target=GPUTarget(*TARGETS[target]), options={"num_warps": num_warps}
        )
    except RuntimeError as error:  # pragma: no cover - a Triton build without that backend
        pytest.skip(f"triton cannot lower for {target}: {error}")


def is_nvidia(target: str) -> bool:
    return TARGETS[target][0] == "cuda"


def binary(compiled, target: str) -> bytes:
    return compiled.asm["cubin" if is_nvidia(target) else "hsaco"]


def machine_code(compiled, target: str) -> str:
    """The PTX (NVIDIA) or AMDGCN (AMD) text."""
    return compiled.asm["ptx" if is_nvidia(target) else "amdgcn"]


def global_accesses(code: str) -> Counter:
    """Global memory instructions by form, e.g. ``{"ld.global.v2.b64": 2}``."""
    return Counter(_ACCESS.findall(code))


def spill_count(compiled, target: str) -> int | None:
    """Spilled registers (AMD: the code object's spill counts) or spill bytes (NVIDIA:
    ``ptxas -v`` from Triton's toolchain); None when nothing here can tell."""
    if not is_nvidia(target):
        counts = re.findall(r"\.[vs]gpr_spill_count:\s*(\d+)", compiled.asm["amdgcn"])
        return sum(int(c) for c in counts) if counts else None
    import triton

    # Triton ships two ptxas builds; the newer PTX versions need the newer one.
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    candidates = [bundled / "ptxas-blackwell", bundled / "ptxas", shutil.which("ptxas")]
    arch = TARGETS[target][1]
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        for ptxas in candidates:
            if ptxas is None or not Path(ptxas).exists():
                continue
            proc = subprocess.run(
                [str(ptxas), f"-arch=sm_{arch}{'a' if arch == 90 else ''}", "-v", str(ptx),
                 "-o", str(Path(tmp) / "kernel.cubin")],
                capture_output=True,
                text=True,
            )  # fmt: skip
            if proc.returncode == 0:
                report = proc.stdout + proc.stderr
                return sum(int(n) for n in re.findall(r"(\d+) bytes spill", report))
    return None
