"""Tokens → chunks → keys: chunking, masks, partial chunks, extra keys, prefix lookup."""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.chunker import Chunker, HashChain, MultiModalSpan, RequestExtras
from kvtier.hashing import ChunkHasher
from kvtier.keys import CacheKey

TEMPLATE = CacheKey("test-model", 1, 0, "bfloat16", b"")


def make_db(chunk_size=4, algorithm="sha256_cbor") -> Chunker:
    return Chunker(chunk_size, ChunkHasher(algorithm), TEMPLATE)


def test_chunk_bounds_full_and_partial():
    db = make_db(4)
    assert [(c.start, c.end) for c in db.chunks(list(range(10)))] == [(0, 4), (4, 8)]
    chunks = db.chunks(list(range(10)), include_partial=True)
    assert [(c.start, c.end) for c in chunks] == [(0, 4), (4, 8), (8, 10)]
    assert [c.index for c in chunks] == [0, 1, 2]
    assert chunks[2].num_tokens == 2
    assert db.chunks([]) == []


def test_keys_carry_template_fields():
    chunk = make_db().chunks(list(range(4)))[0]
    assert (chunk.key.model_name, chunk.key.kv_dtype, chunk.key.layer) == (
        "test-model",
        "bfloat16",
        None,
    )
    assert len(chunk.key.chunk_hash) == 32


@pytest.mark.parametrize("algorithm", ["sha256_cbor", "xxh3_128"])
def test_prefix_property_shared_prefix_shares_keys(algorithm):
    db = make_db(4, algorithm)
    a = db.chunks([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    b = db.chunks([1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0])
    assert [c.key for c in a[:2]] == [c.key for c in b[:2]]
    assert a[2].key != b[2].key
    # a partial chunk never collides with a full one
    p = db.chunks([1, 2, 3, 4, 5, 6], include_partial=True)
    assert p[1].key not in {c.key for c in a}


def test_mask_skips_whole_chunk_prefix_but_hashes_chain_from_start():
    db = make_db(4)
    tokens = list(range(12))
    full = db.chunks(tokens)
    masked = db.chunks(tokens, mask=[False] * 4 + [True] * 8)
    assert [c.key for c in masked] == [c.key for c in full[1:]]
    assert masked[0].index == 1
    masked_t = db.chunks(tokens, mask=torch.tensor([False] * 8 + [True] * 4))
    assert [c.key for c in masked_t] == [full[2].key]
    assert db.chunks(tokens, mask=np.zeros(12, dtype=bool)) == []


@pytest.mark.parametrize(
    "mask, message",
    [
        ([False] * 3 + [True] * 9, "not a multiple of chunk_size=4"),
        ([True] * 4 + [False] * 8, "False prefix followed by True"),
        ([False] * 11, r"shape \(11,\), expected \(12,\)"),
    ],
)
def test_bad_masks_raise(mask, message):
    with pytest.raises(ValueError, match=message):
        make_db(4).chunks(list(range(12)), mask=mask)


def test_tokens_validation():
    with pytest.raises(ValueError, match="one-dimensional"):
        make_db().chunks(torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="integers"):
        make_db().chunks(np.zeros(4, dtype=np.float32))


def test_extra_keys_follow_vllm_tagging():
    extras = RequestExtras(
        lora_name="l",
        lora_path="/p",
        cache_salt="s",
        mm=(MultiModalSpan("img0", 2, 5), MultiModalSpan("img1", 9, 2)),
    )
    assert extras.chunk_extra_keys(0, 4) == (
        ("lora", "l", "/p"),
        ("mm", "img0", 2),
        ("cache_salt", "s"),
    )
    assert extras.chunk_extra_keys(4, 8) == (("lora", "l", "/p"), ("mm", "img0", -2))
    assert extras.chunk_extra_keys(8, 12) == (("lora", "l", "/p"), ("mm", "img1", 1))
    assert extras.chunk_extra_keys(12, 16) == (("lora", "l", "/p"),)
    assert RequestExtras().chunk_extra_keys(0, 4) is None


def test_extras_separate_caches():
    db = make_db(4)
    tokens = list(range(8))
    plain = [c.key for c in db.chunks(tokens)]
    salted = [c.key for c in db.chunks(tokens, extras=RequestExtras(cache_salt="tenant-a"))]
    other = [c.key for c in db.chunks(tokens, extras=RequestExtras(cache_salt="tenant-b"))]
    lora = [c.key for c in db.chunks(tokens, extras=RequestExtras(lora_name="x", lora_path="/x"))]
    # the salt enters the first chunk only, but the chain carries it to every chunk
    assert len({*plain, *salted, *other, *lora}) == 8


@settings(max_examples=60, deadline=None)
@given(
    chunk_size=st.integers(1, 8),
    common=st.lists(st.integers(0, 50), max_size=30),
    tail_a=st.lists(st.integers(0, 50), max_size=20),
    tail_b=st.lists(st.integers(0, 50), max_size=20),
    algorithm=st.sampled_from(["sha256_cbor", "xxh3_128"]),
)
def test_property_shared_keys_are_exactly_the_common_full_chunks(
    chunk_size, common, tail_a, tail_b, algorithm
):
    db = make_db(chunk_size, algorithm)
    a, b = common + tail_a, common + tail_b
    # length of the longest common prefix of the two token lists
    lcp = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    ka = [c.key for c in db.chunks(a)]
    kb = [c.key for c in db.chunks(b)]
    shared = next(
        (i for i, (x, y) in enumerate(zip(ka, kb, strict=False)) if x != y), min(len(ka), len(kb))
    )
    assert shared == min(lcp // chunk_size, len(ka), len(kb))
    # every chunk covers exactly chunk_size tokens and they tile the prefix
    assert all(c.end - c.start == chunk_size for c in db.chunks(a))
    assert sum(c.num_tokens for c in db.chunks(a, include_partial=True)) == len(a)


class ReadCounting(Sequence):
    """A growing token list behind a read-only view, like vLLM's ``ConstantList`` over
    ``Request._all_token_ids``; counts how often each token is read."""

    def __init__(self, tokens: list[int]):
        self._x = tokens
        self.reads: collections.Counter[int] = collections.Counter()

    def __len__(self) -> int:
        return len(self._x)

    def __getitem__(self, item):
        if isinstance(item, slice):
            self.reads.update(range(*item.indices(len(self._x))))
        else:
            self.reads[item] += 1
        return self._x[item]


def test_hash_chain_reads_each_token_once_as_the_sequence_grows():
    """A sequence growing a few tokens a step, asked for its hashes (with the partial last
    chunk) twice a step: full chunks are read once, a partial chunk once per length."""
    rng = np.random.default_rng(4)
    grown = rng.integers(0, 150_000, 1200).tolist()
    tokens = ReadCounting(grown[:700])
    db = make_db(256)
    chain = HashChain(db.hasher, 256, RequestExtras(cache_salt="s"))
    lengths = []
    while len(tokens) < len(grown):
        for _ in range(2):
            hashes = chain.upto(tokens, len(tokens), partial=True)
        expected = db.chunk_hashes(
            grown[: len(tokens)], RequestExtras(cache_salt="s"), include_partial=True
        )
        assert hashes == expected, len(tokens)
        lengths.append(len(tokens))
        tokens._x.extend(grown[len(tokens) : len(tokens) + 3])  # the step's new tokens
    full = len(grown) // 256 * 256
    assert all(tokens.reads[i] == 1 for i in range(512)), "a full chunk was read again"
    partial_reads = sum(n % 256 for n in lengths if n % 256)
    assert sum(tokens.reads.values()) == full + partial_reads


@settings(max_examples=60, deadline=None)
@given(
    chunk_size=st.integers(1, 6),
    tokens=st.lists(st.integers(0, 70_000), max_size=30),
    skipped_chunks=st.integers(0, 6),
    include_partial=st.booleans(),
    salted=st.booleans(),
    algorithm=st.sampled_from(["sha256_cbor", "xxh3_128"]),
)
def test_prompt_chunks_are_the_chunks_hashed_one_at_a_time(
    chunk_size, tokens, skipped_chunks, include_partial, salted, algorithm
):
    db = make_db(chunk_size, algorithm)
    skip = min(skipped_chunks * chunk_size, len(tokens))
    mask = [False] * skip + [True] * (len(tokens) - skip)
    extras = RequestExtras(cache_salt="s", mm=(MultiModalSpan("i", 3, 4),)) if salted else None
    want = db.chunks(tokens, mask, extras, include_partial=include_partial)
    lazy = db.prompt_chunks(tokens, mask, extras, include_partial=include_partial)
    assert len(lazy) == len(want)
    assert lazy.end == (want[-1].end if want else 0)
    assert list(lazy) == want
    assert lazy[-1:] == want[-1:] and (not want or lazy[0] == want[0])


def test_prompt_chunks_hash_a_chunk_when_it_is_asked_for(monkeypatch):
    db = make_db(4)
    hashed: list[int] = []
    chain_array = ChunkHasher.chain_array

    def counting(self, tokens, bounds, *args):
        hashed.append(len(bounds))
        return chain_array(self, tokens, bounds, *args)

    monkeypatch.setattr(ChunkHasher, "chain_array", counting)
    lazy = db.prompt_chunks(list(range(18)), [False] * 8 + [True] * 10, include_partial=True)
    assert (len(lazy), lazy.end, hashed) == (3, 18, [])
    assert lazy[0].index == 2 and hashed == [3]  # the skipped prefix chains into chunk 2
    assert [c.index for c in lazy] == [2, 3, 4] and hashed == [3, 1, 1]
    assert lazy[2].num_tokens == 2 and hashed == [3, 1, 1]  # each chunk hashed once


@pytest.mark.parametrize(
    "mask, message",
    [([False] * 3 + [True] * 9, "not a multiple of chunk_size=4"), ([False] * 11, "shape")],
)
def test_prompt_chunks_check_the_mask_at_once(mask, message):
    with pytest.raises(ValueError, match=message):
        make_db(4).prompt_chunks(list(range(12)), mask=mask)
