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
  check fails on the unaligned fallback, whose paged side moves one word per access;
- RoPE re-rotation, NeoX and GPT-J pairing, bf16 and fp32 keys, on the launch config the
  heuristic picks, moves K 128 bits per global load and store and never one 16-bit
  element per access (GPT-J loads a token's interleaved pairs as one contiguous run and
  splits them in registers). A test shows that the check fails when ``k`` is not known to
  be 16-byte aligned.

Integer arguments carry the divisibility Triton's launcher gives realistic sizes at run
time (16 for pointers, strides, row lengths, and RoPE's ``head_size`` and ``rotary_dim``),
and ``s_dim`` is 1, as Triton specializes it.
"""

from __future__ import annotations

import inspect
import re
from collections import Counter

import pytest
import torch

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

from kvtier_kernels.paged import copy as paged_copy
from kvtier_kernels.rope import rerotation

pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")

# The paged copies' integer words: bf16/fp16 heads move as int64, fp32 heads as int32.
WORDS = ["i64", "i32"]
ONE_WORD_STORES = {
    "i64": {"st.global.b64", "global_store_dwordx2", "buffer_store_dwordx2", "global_store_b64"},
    "i32": {"st.global.b32", "global_store_dword", "buffer_store_dword", "global_store_b32"},
}
# One 16-bit element per access (NVIDIA .b16; AMD short, d16 and b16 forms): what RoPE's
# GPT-J pairing compiled to while it read its pairs with stride 2.
SIXTEEN_BIT = re.compile(r"\.[bsuf]16$|_(?:load|store)_(?:[us]?short|[ui]16|b16|d16)")
OFFSETS_64 = re.compile(r"\bmul\.(?:lo|wide)\.[su]64\b|\bmad\.lo\.[su]64\b")


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
        assert OFFSETS_64.search(code), f"{where}: cache offsets are not computed in 64 bits"


@pytest.mark.parametrize("target", ["sm90", "gfx942"])
def test_the_width_check_fails_on_the_unaligned_fallback(target):
    """Without the alignment hint the paged side moves one word per access: what the check
    above reports if a kernel regresses."""
    compiled = compile_paged_copy("i64", to_chunk=False, aligned=False, target=target)
    accesses = set(global_accesses(machine_code(compiled, target)))
    assert ONE_WORD_STORES["i64"] & accesses, accesses  # the stores into the cache


def compile_rope(is_neox: bool, dtype: str, target: str, aligned: bool = True):
    """``rerotate_kernel`` as the launcher runs it on a 256-token chunk of 128-wide heads
    with full rotary, on the heuristic's launch config; ``k`` 16-byte aligned unless
    ``aligned`` is False. Any ``rotary_dim`` that is a multiple of 16 is marked the same."""
    params = list(inspect.signature(rerotation.rerotate_kernel).parameters)
    pointers = {
        "k": f"*{dtype}",
        "old_positions": "*i64",
        "new_positions": "*i64",
        "inv_freq": "*fp32",
    }
    signature = {
        **pointers,
        **dict.fromkeys(params[4:-3], "i64"),
        "s_dim": "constexpr",
        **dict.fromkeys(params[-3:], "constexpr"),
    }
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    config = rerotation.launch_config(64, 256, torch_dtype, torch.device("cuda"), tuned=False)
    constants = {"s_dim": 1, "IS_NEOX": is_neox}
    constants |= {"BLOCK_T": config.block_tokens, "BLOCK_P": config.block_pairs}
    divisible = [*pointers, "s_layer", "s_token", "head_size", "rotary_dim"]
    if not aligned:
        divisible.remove("k")
    kernel = rerotation.KERNEL.get(interpret=False)
    return compile_for(kernel, signature, constants, target, divisible, config.num_warps)


def narrow_k_accesses(accesses: Counter) -> list[str]:
    """Why a RoPE compile's ``accesses`` do not move K 128 bits at a time (empty: they do).
    Only K is stored, so every store must be 128 bits; K is loaded through the same pointers
    and mask as it is stored, so there are as many 128-bit loads or more (positions and
    ``inv_freq`` add loads of their own); and no access may move one 16-bit element."""
    stores = {f: n for f, n in accesses.items() if f.startswith("st.") or "_store_" in f}
    wide_loads = sum(n for f, n in accesses.items() if WIDE_LOAD.fullmatch(f))
    problems = [f"store {f} is not 128 bits" for f in stores if not WIDE_STORE.fullmatch(f)]
    problems += [f"{f} moves one 16-bit element" for f in accesses if SIXTEEN_BIT.search(f)]
    if wide_loads < max(1, sum(stores.values())):
        problems.append(f"{wide_loads} 128-bit loads for {sum(stores.values())} stores")
    return problems


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_rope_moves_128_bits_per_k_access(target, dtype, is_neox):
    compiled = compile_rope(is_neox, dtype, target)
    assert binary(compiled, target)
    assert "inline_asm" not in compiled.asm["ttgir"]
    code = machine_code(compiled, target)
    accesses = global_accesses(code)
    where = f"{target}, {dtype}, {'neox' if is_neox else 'gptj'}: {dict(accesses)}"
    assert not narrow_k_accesses(accesses), f"{where}: {narrow_k_accesses(accesses)}"
    assert spill_count(compiled, target) in (0, None), where
    if is_nvidia(target):
        assert OFFSETS_64.search(code), f"{where}: cache offsets are not computed in 64 bits"


@pytest.mark.parametrize("target", ["sm90", "gfx942"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_the_rope_width_check_fails_on_an_unaligned_cache(target, is_neox):
    """With ``k`` not known to be 16-byte aligned (a view at an odd offset) K moves one
    bf16 element per access: what the check above reports if the kernel regresses."""
    compiled = compile_rope(is_neox, "bf16", target, aligned=False)
    accesses = global_accesses(machine_code(compiled, target))
    problems = narrow_k_accesses(accesses)
    assert any("moves one 16-bit element" in p for p in problems), accesses
    assert any("is not 128 bits" in p for p in problems), accesses


@pytest.mark.parametrize("target", ["sm80", "gfx942"])
def test_spill_counts_are_read_here(target):
    """The spill checks above are real on this machine: ptxas (Triton's) and the AMD code
    object both report a count."""
    compiled = compile_paged_copy("i64", to_chunk=True, aligned=True, target=target)
    assert spill_count(compiled, target) == 0
