"""Chained chunk hashes: vLLM compatibility, determinism across processes, separation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.hash_seeds import same_output_under_hash_seeds

from kvtier.chunker import Chunker, MultiModalSpan, RequestExtras
from kvtier.hashing import HASH_ALGORITHMS, ChunkHasher
from kvtier.keys import CacheKey

# Golden values computed with vLLM 0.32's own code:
#   init_none_hash(sha256_cbor); hash_block_tokens(sha256_cbor, parent, tokens, extra)
VLLM_NONE_HASH = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
VLLM_BLOCK_0 = "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749"
VLLM_BLOCK_1_WITH_EXTRA = "e5fad6a42ee967f5016f0b34a82fe97a47379048f8b997d6ac84b1c69e2cdffb"

# Chunk hashes and a key of one prompt with every kind of extra key, as every kvtier
# version since the first computes them (docs/upgrading.md#mixed-versions).
KVTIER_CHUNK_HASHES = {
    "sha256_cbor": [
        "62a4f91670c88b2b316b356a8e168a8b57b87d0ec0d4e36243d89f73a3911ff9",
        "d0e43344a01e7e1fa4b2ab4ee6516393f786b873a14abe826e705526affc7cd1",
        "422788258169a39a9fe94d7d0fc625475eec1a575e725244d1e08c9a870be982",
    ],
    "xxh3_128": [
        "dcef1dc6070908e548e7c3a34bcfaf83",
        "274e9e62ee31c1ecfa344cf135c73a00",
        "886abd9557304bdf589d30e27de1a0d6",
    ],
}


def test_sha256_cbor_matches_vllm_golden_values():
    hasher = ChunkHasher("sha256_cbor", "vllm-none-hash")
    assert hasher.root().hex() == VLLM_NONE_HASH
    h0 = hasher.hash_chunk(hasher.root(), list(range(16)))
    assert h0.hex() == VLLM_BLOCK_0
    extra = (("lora", "my-lora", "/adapters/a"), ("cache_salt", "tenant-1"))
    h1 = hasher.hash_chunk(h0, list(range(16, 32)), extra)
    assert h1.hex() == VLLM_BLOCK_1_WITH_EXTRA


def test_sha256_cbor_chunk_hashes_equal_vllms_own_function_byte_for_byte():
    """Against vLLM's ``hash_block_tokens`` itself (not stored values), on a long prompt
    of random ids across every CBOR integer width, through the token database's path."""
    kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.utils.hashing import sha256_cbor as vllm_sha256_cbor

    from kvtier.chunker import Chunker
    from kvtier.keys import CacheKey

    kv_cache_utils.init_none_hash(vllm_sha256_cbor)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 200_000, 4096)
    tokens[:40] = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, *range(30)]
    db = Chunker(256, ChunkHasher("sha256_cbor"), CacheKey("m", 1, 0, "bf16", b""))
    ours = db.chunk_hashes(torch.from_numpy(tokens))
    parent, theirs = kv_cache_utils.NONE_HASH, []
    as_list = tokens.tolist()
    for start in range(0, len(as_list), 256):
        parent = kv_cache_utils.hash_block_tokens(
            vllm_sha256_cbor, parent, as_list[start : start + 256], None
        )
        theirs.append(bytes(parent))
    assert ours == theirs
    # NumPy integers in a plain list hash like Python ints
    hasher = ChunkHasher("sha256_cbor")
    assert hasher.hash_chunk(b"p", [np.int64(t) for t in as_list[:9]]) == hasher.hash_chunk(
        b"p", as_list[:9]
    )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("high", [24, 256, 65_536, 200_000, 2**32, 2**40])
def test_vectorised_chain_equals_vllms_function_with_extras(seed, high):
    """``chain_array`` (one vectorised CBOR pass; ids of 2**32 and up take cbor2's path)
    gives vLLM's ``hash_block_tokens`` bytes, with extra keys and a partial last chunk."""
    kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.utils.hashing import sha256_cbor as vllm_sha256_cbor

    kv_cache_utils.init_none_hash(vllm_sha256_cbor)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, high, int(rng.integers(1, 700)))
    tokens[: min(4, tokens.size)] = [0, 23, high - 1, high // 2][: min(4, tokens.size)]
    size = int(rng.choice([1, 16, 64, 256]))
    bounds = [(s, min(s + size, tokens.size)) for s in range(0, tokens.size, size)]
    extras = [
        None if i % 3 else (("lora", "a", "/p"), ("mm", "h" * 64, i), ("cache_salt", "t"))
        for i in range(len(bounds))
    ]
    ours = ChunkHasher("sha256_cbor").chain_array(tokens, bounds, extras)
    parent, theirs = kv_cache_utils.NONE_HASH, []
    for (start, end), extra in zip(bounds, extras, strict=True):
        block = tokens[start:end].tolist()
        parent = kv_cache_utils.hash_block_tokens(vllm_sha256_cbor, parent, block, extra)
        theirs.append(bytes(parent))
    assert ours == theirs


@pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
def test_chain_array_equals_chain(algorithm):
    hasher = ChunkHasher(algorithm)
    tokens = np.random.default_rng(0).integers(-5, 70_000, 1000)  # negatives: cbor2 path
    bounds = [(s, min(s + 128, 1000)) for s in range(0, 1000, 128)]
    pieces = [tokens[s:e].tolist() for s, e in bounds]
    assert hasher.chain_array(tokens, bounds) == hasher.chain(pieces)
    assert hasher.chain_array(np.abs(tokens), bounds, parent=b"p") == hasher.chain(
        [np.abs(tokens[s:e]).tolist() for s, e in bounds], parent=b"p"
    )
    assert hasher.chain_array(tokens[:0], []) == []


@pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
def test_token_container_types_hash_the_same(algorithm):
    hasher = ChunkHasher(algorithm)
    tokens = [5, 17, 2**31 - 1, 0, 42]
    expected = hasher.hash_chunk(hasher.root(), tokens)
    for form in (
        tuple(tokens),
        np.array(tokens, dtype=np.int32),
        np.array(tokens, dtype=np.int64),
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(tokens, dtype=torch.int32),
    ):
        assert hasher.hash_chunk(hasher.root(), form) == expected, type(form)


@pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
def test_chain_separates_prefix_seed_extra_and_order(algorithm):
    hasher = ChunkHasher(algorithm)
    a, b = list(range(8)), list(range(8, 16))
    ha = hasher.chain([a, b])
    assert len(ha) == 2 and len(set(ha)) == 2
    assert len(ha[0]) == hasher.digest_size
    # same second chunk after a different first chunk -> different hash
    assert hasher.chain([b, b])[1] != ha[1]
    # a different seed changes everything
    other_seed = ChunkHasher(algorithm, "another-seed").chain([a, b])
    assert set(other_seed).isdisjoint(ha)
    # extra keys separate caches
    assert hasher.chain([a, b], [(("lora", "x", None),), None])[0] != ha[0]
    # the algorithms differ from each other
    other = next(x for x in HASH_ALGORITHMS if x != algorithm)
    assert ChunkHasher(other).chain([a, b]) != ha


def test_unknown_algorithm_names_choices():
    with pytest.raises(ValueError, match=r"md5.*sha256_cbor, xxh3_128"):
        ChunkHasher("md5")


def test_chain_rejects_mismatched_extras():
    with pytest.raises(ValueError, match="2 extra keys for 1 chunks"):
        ChunkHasher().chain([[1, 2]], [None, None])


_CHILD = """
import sys
from kvtier.hashing import ChunkHasher
tokens = list(range(1000, 1000 + 1024))
for algo in ("sha256_cbor", "xxh3_128"):
    chunks = [tokens[i:i + 256] for i in range(0, 1024, 256)]
    print(algo, ",".join(h.hex() for h in ChunkHasher(algo, "seed-x").chain(chunks)))
"""


def test_hashes_identical_across_processes_with_different_pythonhashseed():
    lines = same_output_under_hash_seeds(_CHILD, ("0", "1", "12345", "random")).strip().splitlines()
    assert [line.split()[0] for line in lines] == ["sha256_cbor", "xxh3_128"]
    # and the in-process result is the same
    tokens = list(range(1000, 1000 + 1024))
    chunks = [tokens[i : i + 256] for i in range(0, 1024, 256)]
    here = ",".join(h.hex() for h in ChunkHasher("sha256_cbor", "seed-x").chain(chunks))
    assert lines[0].split()[1] == here


def _vllm_block_hashes(tokens: list[int], bounds, extras=None) -> list[bytes]:
    """vLLM's own ``hash_block_tokens`` over ``bounds`` of ``tokens`` (a ``list[int]``, as
    its ``Request`` holds them)."""
    kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.utils.hashing import sha256_cbor as vllm_sha256_cbor

    kv_cache_utils.init_none_hash(vllm_sha256_cbor)
    parent, out = kv_cache_utils.NONE_HASH, []
    for i, (start, end) in enumerate(bounds):
        extra = None if extras is None else extras[i]
        parent = kv_cache_utils.hash_block_tokens(
            vllm_sha256_cbor, parent, tokens[start:end], extra
        )
        out.append(bytes(parent))
    return out


@pytest.mark.parametrize("block", [16, 256])
@pytest.mark.parametrize("high", [24, 65_536, 200_000, 2**32])
def test_list_input_hashes_equal_vllms_function(block, high):
    """A ``list[int]`` (read through ``array.array``, not NumPy) gives vLLM's bytes, through
    ``chain_array`` and the chunker, with ids at every CBOR width up to ``2**32 - 1``."""
    from kvtier.chunker import Chunker
    from kvtier.keys import CacheKey

    rng = np.random.default_rng(high)
    tokens = rng.integers(0, high, 3000).tolist()
    tokens[:9] = [0, 23, 24, 255, 256, 65535, 65536, high - 1, high // 2]
    bounds = [(s, min(s + block, len(tokens))) for s in range(0, len(tokens), block)]
    theirs = _vllm_block_hashes(tokens, bounds)
    assert ChunkHasher("sha256_cbor").chain_array(tokens, bounds) == theirs
    db = Chunker(block, ChunkHasher("sha256_cbor"), CacheKey("m", 1, 0, "bf16", b""))
    assert db.chunk_hashes(tokens, include_partial=True) == theirs
    assert db.chunk_hashes(tuple(tokens), include_partial=True) == theirs


@pytest.mark.parametrize("odd", [-1, -(2**40), 2**32, 2**62])
def test_list_input_outside_uint32_takes_cbor2s_path(odd):
    """Negative ids and ids of ``2**32`` and up leave the vectorised encoding for cbor2's
    (the same bytes as vLLM's function, whose CBOR they are)."""
    tokens = list(range(1000, 1600))
    tokens[300] = odd
    bounds = [(s, min(s + 256, 600)) for s in range(0, 600, 256)]
    hasher = ChunkHasher("sha256_cbor")
    ours = hasher.chain_array(tokens, bounds)
    assert ours == hasher.chain([tokens[s:e] for s, e in bounds])
    assert ours == _vllm_block_hashes(tokens, bounds)
    assert ChunkHasher("xxh3_128").chain_array(tokens[:300], [(0, 300)]) == ChunkHasher(
        "xxh3_128"
    ).chain([tokens[:300]])


def test_list_input_with_extra_keys_equals_vllms_function():
    tokens = np.random.default_rng(5).integers(0, 150_000, 1000).tolist()
    bounds = [(s, min(s + 128, 1000)) for s in range(0, 1000, 128)]
    lora = ("lora", "my-lora", "/adapters/a")
    extras = [
        (lora, ("mm", "f" * 64, 3), ("cache_salt", "tenant-1")) if i == 0 else (lora,)
        for i in range(len(bounds))
    ]
    extras[3] = None
    ours = ChunkHasher("sha256_cbor").chain_array(tokens, bounds, extras)
    assert ours == _vllm_block_hashes(tokens, bounds, extras)


def test_chain_array_across_encoding_passes():
    """Prompts longer than one encoding pass (and chunks longer than a pass) chain
    through the passes with cbor2's bytes."""
    tokens = np.random.default_rng(8).integers(0, 1 << 32, 70_000, dtype=np.uint64).tolist()
    hasher = ChunkHasher("sha256_cbor")
    for size in (256, 50_000):
        bounds = [(s, min(s + size, len(tokens))) for s in range(0, len(tokens), size)]
        expected = hasher.chain([tokens[s:e] for s, e in bounds])
        assert hasher.chain_array(tokens, bounds) == expected, size


def test_threads_hash_concurrently():
    """Each thread encodes in its own work arrays."""
    from concurrent.futures import ThreadPoolExecutor

    hasher = ChunkHasher("sha256_cbor")
    prompts = [
        np.random.default_rng(seed).integers(0, 200_000, 5000 + 997 * seed).tolist()
        for seed in range(8)
    ]

    def hashes(tokens):
        return hasher.chain_array(
            tokens, [(s, min(s + 64, len(tokens))) for s in range(0, len(tokens), 64)]
        )

    expected = [hashes(p) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            assert list(pool.map(hashes, prompts)) == expected


def test_token_array_reads_lists_and_rejects_what_is_not_token_ids():
    from kvtier.hashing import token_array

    assert token_array([3, 2**32 - 1]).dtype == np.uint32
    assert token_array([-3, 7]).tolist() == [-3, 7]
    assert token_array([2**32]).tolist() == [2**32]
    assert token_array([]).size == 0
    assert token_array([np.int64(5), np.int32(6)]).tolist() == [5, 6]
    array = np.arange(5, dtype=np.int32)
    assert token_array(array) is array
    for bad, message in (([1.5, 2.0], "integers"), ([[1, 2]], "one-dimensional"), (b"ab", "one")):
        with pytest.raises(ValueError, match=message):
            token_array(bad)


@pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
def test_chunk_hashes_and_keys_are_those_of_every_earlier_kvtier(algorithm):
    """Engines of two kvtier versions share stores during an upgrade: a change here turns
    every cache cold, and could let one version read another's chunk as the KV of other
    tokens. These values are what every kvtier so far computes; change them only with a
    note in docs/upgrading.md that the cache turns cold."""
    tokens = [i * 997 % 200_000 for i in range(300)]  # ids of every CBOR width
    extras = RequestExtras(
        lora_name="ad", lora_path="/p/ad", mm=(MultiModalSpan("img", 100, 50),), cache_salt="t"
    )
    template = CacheKey("org/m", 2, 1, "bfloat16", b"\0")
    chunker = Chunker(128, ChunkHasher(algorithm, "vllm-none-hash"), template)
    hashes = [h.hex() for h in chunker.chunk_hashes(tokens, extras, include_partial=True)]
    assert hashes == KVTIER_CHUNK_HASHES[algorithm]
    assert chunker.chunks(tokens, None, extras)[-1].key.to_string() == (
        f"kvtier1@org%2Fm@2@1@bfloat16@{hashes[1]}"
    )
