"""The paged-copy and RoPE kernels compiled for NVIDIA and AMD targets without a GPU, and
their machine code inspected (``make gpu-check``; the rANS kernels' twin checks are in
``test_cachegen_kernels.py``).

For sm80, sm90, gfx90a, gfx942 and gfx1100, Triton lowers each kernel with an explicit
``GPUTarget`` and the tests assert that:

- it compiles, with no inline assembly;
- it spills no registers (AMD: the code object's spill counts; NVIDIA: ``ptxas -v`` from
  Triton's own toolchain);
- cache offsets are computed in 64 bits (NVIDIA: 64-bit multiplies in the PTX), so caches
  past 2 GiB are addressed right;
- the paged copies move 128 bits per global load and store, on the chunk side and on the
  paged side, when the caches are 16-byte aligned (``ALIGNED``). A test shows that the
  check fails on the unaligned fallback, whose paged side moves one word per access.

Integer arguments carry the divisibility Triton's launcher gives realistic sizes at run
time (16 for pointers, strides and row lengths), and ``s_dim`` is 1, as Triton
specializes it.
"""

from __future__ import annotations

import inspect
import re

import pytest

pytest.importorskip("triton")

from support.gpu_compile import (
    TARGETS,
    WIDE_LOAD,
    WIDE_STORE,
    binary,
    compile_for,
    global_accesses,
    is_nvidia,
    machine_code,
    spill_count,
)

from kvtier_kernels import paged_copy, rope

pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")

# The paged copies' integer words: bf16/fp16 heads move as int64, fp32 heads as int32.
WORDS = ["i64", "i32"]
ONE_WORD_STORES = {
    "i64": {"st.global.b64", "global_store_dwordx2", "buffer_store_dwordx2", "global_store_b64"},
    "i32": {"st.global.b32", "global_store_dword", "buffer_store_dword", "global_store_b32"},
}


def compile_paged_copy(word: str, to_chunk: bool, aligned: bool, target: str):
    params = list(inspect.signature(paged_copy.paged_copy_kernel).parameters)
    ints = params[3:-4]  # strides and sizes, between the pointers and the constexprs
    signature = {
        "layer_bases": "*i64",
        "slot_mapping": "*i64",
        "chunk": f"*{word}",
        **dict.fromkeys(ints, "i64"),
        "s_dim": "constexpr",
        **dict.fromkeys(params[-4:], "constexpr"),
    }
    # 4 KiB tiles with 4 warps: what launch_config picks for 128-wide bf16 heads
    constants = {
        "s_dim": 1,
        "TO_CHUNK": to_chunk,
        "ALIGNED": aligned,
        "BLOCK_T": 8,
        "BLOCK_R": 64 if word == "i64" else 128,
    }
    pointers = ["layer_bases", "slot_mapping", "chunk"]
    divisible = [*pointers, *(n for n in ints if n not in ("s_dim", "num_tokens"))]
    kernel = paged_copy.KERNEL.get(interpret=False)
    return compile_for(kernel, signature, constants, target, divisible)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("word", WORDS)
@pytest.mark.parametrize("to_chunk", [True, False], ids=["gather", "scatter"])
def test_paged_copy_moves_128_bits_per_access_on_both_sides(target, word, to_chunk):
    compiled = compile_paged_copy(word, to_chunk, aligned=True, target=target)
    assert binary(compiled, target)
    assert "inline_asm" not in compiled.asm["ttgir"]
    code = machine_code(compiled, target)
    accesses = global_accesses(code)
    where = f"{target}, {word} words, {'gather' if to_chunk else 'scatter'}: {dict(accesses)}"
    # one side is read and the other written: both 128 bits wide, no one-word KV stores
    assert WIDE_LOAD.search(code) and WIDE_STORE.search(code), where
    assert not ONE_WORD_STORES[word] & set(accesses), where
    assert spill_count(compiled, target) in (0, None), where
    if is_nvidia(target):
        assert re.search(r"\bmul\.(?:lo|wide)\.[su]64\b|\bmad\.lo\.[su]64\b", code), (
            f"{where}: cache offsets are not computed in 64 bits"
        )


@pytest.mark.parametrize("target", ["sm90", "gfx942"])
def test_the_width_check_fails_on_the_unaligned_fallback(target):
    """Without the alignment hint the paged side moves one word per access: what the check
    above reports if a kernel regresses."""
    compiled = compile_paged_copy("i64", to_chunk=False, aligned=False, target=target)
    accesses = set(global_accesses(machine_code(compiled, target)))
    assert ONE_WORD_STORES["i64"] & accesses, accesses  # the stores into the cache


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_rope_compiles_without_spills(target, is_neox):
    params = list(inspect.signature(rope.rerotate_kernel).parameters)
    ints = params[4:-3]
    signature = {
        "k": "*bf16",
        "old_positions": "*i64",
        "new_positions": "*i64",
        "inv_freq": "*fp32",
        **dict.fromkeys(ints, "i64"),
        **dict.fromkeys(params[-3:], "constexpr"),
    }
    constants = {"IS_NEOX": is_neox, "BLOCK_T": 16, "BLOCK_P": 64}
    divisible = ["k", "old_positions", "new_positions", "inv_freq", "s_layer", "s_token"]
    kernel = rope.KERNEL.get(interpret=False)
    compiled = compile_for(kernel, signature, constants, target, divisible)
    assert binary(compiled, target)
    assert "inline_asm" not in compiled.asm["ttgir"]
    assert spill_count(compiled, target) in (0, None)


@pytest.mark.parametrize("target", ["sm80", "gfx942"])
def test_spill_counts_are_read_here(target):
    """The spill checks above are real on this machine: ptxas (Triton's) and the AMD code
    object both report a count."""
    compiled = compile_paged_copy("i64", to_chunk=True, aligned=True, target=target)
    assert spill_count(compiled, target) == 0
