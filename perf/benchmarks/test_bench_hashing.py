"""Chunk hashing throughput (tokens/s) for each algorithm, and the ratio between them;
``sha256_cbor`` against vLLM's own ``hash_block_tokens`` (the same bytes), from a tensor of
token ids and from the ``list[int]`` vLLM's ``Request`` holds."""

from __future__ import annotations

import pytest
import torch
from conftest import interleaved_medians

from kvtier.chunker import Chunker
from kvtier.hashing import HASH_ALGORITHMS, ChunkHasher
from kvtier.keys import CacheKey

NUM_TOKENS = 64 * 1024
CHUNK_SIZE = 256


def _db(algorithm: str) -> Chunker:
    return Chunker(CHUNK_SIZE, ChunkHasher(algorithm), CacheKey("bench", 1, 0, "bfloat16", b""))


def _tokens() -> torch.Tensor:
    return torch.randint(0, 128_000, (NUM_TOKENS,), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
def test_chunk_hashing(benchmark, record, algorithm):
    tokens = _tokens()
    db = _db(algorithm)
    benchmark(db.chunk_hashes, tokens)
    baseline = "sha256_cbor" if algorithm != "sha256_cbor" else "xxh3_128"
    seconds, baseline_seconds = interleaved_medians(
        lambda: db.chunk_hashes(tokens), lambda: _db(baseline).chunk_hashes(tokens)
    )
    record(
        metric="chunk hashing",
        algorithm=algorithm,
        value=NUM_TOKENS / seconds / 1e6,
        unit="Mtokens/s",
        baseline=f"{baseline} (same run)",
        baseline_value=NUM_TOKENS / baseline_seconds / 1e6,
    )
    benchmark.extra_info["mtokens_per_s"] = NUM_TOKENS / seconds / 1e6


def _versus_vllm(benchmark, record, vllm_block_size: int, tokens, input_name: str) -> None:
    """kvtier's sha256_cbor chunk hashes of ``tokens`` against vLLM's ``hash_block_tokens``
    over the same ids as the ``list[int]`` it takes (from a tensor: its ``tolist()``,
    timed), in the same run, timed in alternation."""
    kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.utils.hashing import sha256_cbor as vllm_sha256_cbor

    kv_cache_utils.init_none_hash(vllm_sha256_cbor)
    db = _db("sha256_cbor")
    benchmark(db.chunk_hashes, tokens)

    def vllm_hashes() -> None:
        as_list = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
        parent = kv_cache_utils.NONE_HASH
        for start in range(0, NUM_TOKENS, vllm_block_size):
            block = as_list[start : start + vllm_block_size]
            parent = kv_cache_utils.hash_block_tokens(vllm_sha256_cbor, parent, block, None)

    seconds, baseline_seconds = interleaved_medians(
        lambda: db.chunk_hashes(tokens), vllm_hashes, repeat=25
    )
    record(
        metric="chunk hashing",
        algorithm=f"sha256_cbor vs vLLM, {vllm_block_size}-token blocks{input_name}",
        value=NUM_TOKENS / seconds / 1e6,
        unit="Mtokens/s",
        baseline=f"vLLM hash_block_tokens, {vllm_block_size}-token blocks{input_name} (same run)",
        baseline_value=NUM_TOKENS / baseline_seconds / 1e6,
    )


@pytest.mark.parametrize("vllm_block_size", [16, CHUNK_SIZE])
def test_sha256_cbor_vs_vllms_block_hash(benchmark, record, vllm_block_size):
    """From a tensor of token ids (the worker side's input), at vLLM's default GPU block
    size and at kvtier's chunk size."""
    _versus_vllm(benchmark, record, vllm_block_size, _tokens(), "")


@pytest.mark.parametrize("vllm_block_size", [16, CHUNK_SIZE])
def test_sha256_cbor_vs_vllms_block_hash_list_input(benchmark, record, vllm_block_size):
    """From a ``list[int]``, as vLLM's ``Request`` holds its tokens (the scheduler side's
    input, and the form vLLM's function takes as it is)."""
    _versus_vllm(benchmark, record, vllm_block_size, _tokens().tolist(), ", list[int] input")
