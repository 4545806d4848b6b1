"""Chunk hashing throughput (tokens/s) for each algorithm, and the ratio between them."""

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


@pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
def test_chunk_hashing(benchmark, record, algorithm):
    tokens = torch.randint(0, 128_000, (NUM_TOKENS,), generator=torch.Generator().manual_seed(0))
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


@pytest.mark.parametrize("vllm_block_size", [16, CHUNK_SIZE])
def test_sha256_cbor_vs_vllms_block_hash(benchmark, record, vllm_block_size):
    """kvtier's sha256_cbor chunk hashes (same bytes as vLLM's) against vLLM's own
    ``hash_block_tokens`` over the same tokens, at vLLM's default GPU block size and at
    kvtier's chunk size, in the same run, timed in alternation."""
    kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.utils.hashing import sha256_cbor as vllm_sha256_cbor

    kv_cache_utils.init_none_hash(vllm_sha256_cbor)
    tokens = torch.randint(0, 128_000, (NUM_TOKENS,), generator=torch.Generator().manual_seed(0))
    db = _db("sha256_cbor")
    benchmark(db.chunk_hashes, tokens)

    def vllm_hashes() -> None:
        as_list, parent = tokens.tolist(), kv_cache_utils.NONE_HASH
        for start in range(0, NUM_TOKENS, vllm_block_size):
            block = as_list[start : start + vllm_block_size]
            parent = kv_cache_utils.hash_block_tokens(vllm_sha256_cbor, parent, block, None)

    seconds, baseline_seconds = interleaved_medians(
        lambda: db.chunk_hashes(tokens), vllm_hashes, repeat=9
    )
    record(
        metric="chunk hashing",
        algorithm=f"sha256_cbor vs vLLM, {vllm_block_size}-token blocks",
        value=NUM_TOKENS / seconds / 1e6,
        unit="Mtokens/s",
        baseline=f"vLLM hash_block_tokens, {vllm_block_size}-token blocks (same run)",
        baseline_value=NUM_TOKENS / baseline_seconds / 1e6,
    )
