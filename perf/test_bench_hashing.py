"""Chunk hashing throughput (tokens/s) for each algorithm, and the ratio between them."""

from __future__ import annotations

import pytest
import torch
from conftest import median_seconds

from kvtier.hashing import HASH_ALGORITHMS, ChunkHasher
from kvtier.keys import CacheKey
from kvtier.token_db import ChunkedTokenDatabase

NUM_TOKENS = 64 * 1024
CHUNK_SIZE = 256


def _db(algorithm: str) -> ChunkedTokenDatabase:
    return ChunkedTokenDatabase(
        CHUNK_SIZE, ChunkHasher(algorithm), CacheKey("bench", 1, 0, "bfloat16", b"")
    )


@pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
def test_chunk_hashing(benchmark, record, algorithm):
    tokens = torch.randint(0, 128_000, (NUM_TOKENS,), generator=torch.Generator().manual_seed(0))
    db = _db(algorithm)
    benchmark(db.chunk_hashes, tokens)
    seconds = benchmark.stats.stats.median
    baseline = "sha256_cbor" if algorithm != "sha256_cbor" else "xxh3_128"
    baseline_seconds = median_seconds(lambda: _db(baseline).chunk_hashes(tokens))
    record(
        metric="chunk hashing",
        algorithm=algorithm,
        value=NUM_TOKENS / seconds / 1e6,
        unit="Mtokens/s",
        baseline=f"{baseline} (same run)",
        baseline_value=NUM_TOKENS / baseline_seconds / 1e6,
    )
    benchmark.extra_info["mtokens_per_s"] = NUM_TOKENS / seconds / 1e6
