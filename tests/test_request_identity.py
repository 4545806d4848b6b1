"""What keeps one request's KV apart from another's besides its tokens, read off fakes of
vLLM's ``Request`` as the scheduler side reads them: prompt embeddings (whose token ids
are placeholders), multimodal items, LoRA, the cache salt; and keys equal in every
process whatever ``PYTHONHASHSEED``, and whatever container holds the token ids."""

from __future__ import annotations

import array
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support.hash_seeds import same_output_under_hash_seeds
from test_vllm_scheduler_side import (
    CHUNK,
    FakeLora,
    FakeMMFeature,
    FakePosition,
    FakeRequest,
    HeldHashes,
    blocks_for,
    expected_hashes,
    hit_and_plan,
    make_config,
    make_side,
)

from kvtier.chunker import Chunker, PromptEmbeds, RequestExtras
from kvtier.hashing import ChunkHasher
from kvtier.integration.vllm import facts
from kvtier.integration.vllm.facts import request_extras
from kvtier.keys import CacheKey


@dataclass
class FakeEmbedsRequest(FakeRequest):
    """A request given as ``{"prompt_embeds": tensor}``: vLLM's ``all_token_ids`` are
    zeros, one per embedding row."""

    prompt_embeds: torch.Tensor | None = None


def embeds_request(req_id: str, num_tokens: int, seed: int) -> FakeEmbedsRequest:
    rows = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(seed))
    return FakeEmbedsRequest(req_id, [0] * num_tokens, num_tokens, prompt_embeds=rows)


def saved_hashes(side, request) -> list[bytes]:
    _, plan = hit_and_plan(side, request, 0, blocks_for(request.num_prompt_tokens))
    return [h for save in plan.saves for h in save.hashes]


def test_prompt_embeds_of_the_same_length_never_share_chunks():
    held = HeldHashes()
    side = make_side(held)
    one, two = embeds_request("one", 300, seed=1), embeds_request("two", 300, seed=2)
    hashes_one = saved_hashes(side, one)
    assert len(hashes_one) == 4, f"saved {len(hashes_one)} chunks, expected 4"
    held.hold(hashes_one)
    got = side.get_num_new_matched_tokens(two, 0)
    assert got == (0, False), f"other embeddings, same placeholder ids: hit {got}"
    shared = set(hashes_one) & set(saved_hashes(side, two))
    assert not shared, "two requests' embeddings gave chunks the same hash"
    plain = FakeRequest("plain", [0] * 300, 300)
    assert side.get_num_new_matched_tokens(plain, 0) == (0, False), (
        "a token-id prompt of the embeddings' placeholder ids hit their chunks"
    )


def test_the_same_prompt_embeds_share_chunks():
    held = HeldHashes()
    side = make_side(held)
    one = embeds_request("one", 300, seed=1)
    held.hold(saved_hashes(side, one))
    again = FakeEmbedsRequest(
        "again", [0] * 300, 300, prompt_embeds=one.prompt_embeds.clone()
    )  # equal rows in another tensor: what a second request, or process, holds
    assert side.get_num_new_matched_tokens(again, 0) == (4 * CHUNK, False)


def test_prompt_embeds_keys_are_vllms():
    """With ``chunk_size`` equal to the block size a chunk's hash is vLLM's block hash of
    a request given as embeddings (``_gen_prompt_embeds_extra_hash_keys``)."""
    kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.utils.hashing import sha256_cbor as vllm_sha256_cbor

    rows = torch.randn(100, 16, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    request = SimpleNamespace(
        mm_features=None,
        lora_request=None,
        cache_salt="tenant",
        prompt_embeds=rows,
        _prompt_embeds_per_block_hashes={},
    )
    kv_cache_utils.init_none_hash(vllm_sha256_cbor)
    parent, want = kv_cache_utils.NONE_HASH, []
    for start in range(0, 96, 32):
        extra, _ = kv_cache_utils.generate_block_hash_extra_keys(request, start, start + 32, 0)
        parent = kv_cache_utils.hash_block_tokens(vllm_sha256_cbor, parent, [0] * 32, extra)
        want.append(bytes(parent))
    chunker = Chunker(32, ChunkHasher(), CacheKey("m", 1, 0, "bfloat16", b""))
    got = chunker.chunk_hashes([0] * 100, request_extras(request))
    assert got == want


def test_lora_with_an_empty_name_is_keyed():
    """vLLM keys every LoRA request, whatever its name."""
    config = make_config()
    request = FakeRequest("r", list(range(1, 201)), 200, lora_request=FakeLora("", "/l/x"))
    extras = request_extras(request)
    assert expected_hashes(config, request.all_token_ids, extras) != expected_hashes(
        config, request.all_token_ids
    )


def test_images_at_the_same_positions_never_share_and_the_same_image_does():
    held = HeldHashes()
    side = make_side(held)
    tokens = [7] * 300  # placeholder tokens: the same for every image

    def request(req_id: str, image: str) -> FakeRequest:
        feature = FakeMMFeature(image, FakePosition(64, 128))
        return FakeRequest(req_id, list(tokens), 300, mm_features=[feature])

    first = saved_hashes(side, request("one", "img-a"))
    held.hold(first)
    got = side.get_num_new_matched_tokens(request("two", "img-b"), 0)
    assert got == (CHUNK, False), f"hit {got}: only the chunk before the image is shared"
    other_image = request("other", "img-b")
    other = expected_hashes(side.config, tokens, request_extras(other_image))
    assert first[0] == other[0], "the chunk before the image differs"
    assert not set(first[1:]) & set(other[1:]), "chunks with other images share a hash"
    assert side.get_num_new_matched_tokens(request("three", "img-a"), 0) == (4 * CHUNK, False)


_TOKENS = [int(t) for t in np.random.default_rng(9).integers(0, 150_000, 300)]


@pytest.mark.parametrize(
    "container",
    [
        list,
        tuple,
        lambda t: array.array("l", t),
        lambda t: array.array("I", t),
        lambda t: np.array(t, dtype=np.int32),
        lambda t: np.array(t, dtype=np.int64),
        lambda t: torch.tensor(t, dtype=torch.int64),
        lambda t: torch.tensor(t, dtype=torch.int32),
    ],
    ids=["list", "tuple", "array-l", "array-I", "np-int32", "np-int64", "torch-64", "torch-32"],
)
@pytest.mark.parametrize("algorithm", ["sha256_cbor", "xxh3_128"])
def test_token_containers_give_the_same_keys(container, algorithm):
    chunker = Chunker(64, ChunkHasher(algorithm), CacheKey("m", 1, 0, "bfloat16", b""))
    extras = RequestExtras(lora_name="a", lora_path="/l/a", cache_salt="s")
    want = chunker.chunk_hashes(_TOKENS, extras, include_partial=True)
    got = chunker.chunk_hashes(container(_TOKENS), extras, include_partial=True)
    assert got == want
    assert [c.key for c in chunker.chunks(container(_TOKENS), extras=extras)] == [
        chunker.key(h) for h in want[:-1]
    ]


_CHILD = """
import torch
from kvtier.chunker import Chunker, MultiModalSpan, PromptEmbeds, RequestExtras
from kvtier.hashing import ChunkHasher
from kvtier.keys import CacheKey
rows = torch.randn(300, 16, generator=torch.Generator().manual_seed(4))
cases = {
    "salt": RequestExtras(cache_salt="tenant"),
    "lora": RequestExtras(lora_name="a", lora_path="/l/a"),
    "mm": RequestExtras(mm=(MultiModalSpan("img-a", 10, 100),)),
    "mm-other": RequestExtras(mm=(MultiModalSpan("img-b", 10, 100),)),
    "embeds": RequestExtras(prompt_embeds=PromptEmbeds(rows)),
}
for algo in ("sha256_cbor", "xxh3_128"):
    chunker = Chunker(64, ChunkHasher(algo), CacheKey("m", 1, 0, "bfloat16", b""))
    for name, extras in cases.items():
        keys = chunker.chunks(list(range(300)), extras=extras, include_partial=True)
        print(algo, name, ",".join(str(c.key) for c in keys))
"""


def test_keys_with_extras_equal_across_processes_with_different_pythonhashseed():
    lines = same_output_under_hash_seeds(_CHILD, ("0", "1", "4242", "random")).strip().splitlines()
    assert len(lines) == 10
    assert len({line.split()[2] for line in lines}) == 10, "two cases share keys"
    rows = torch.randn(300, 16, generator=torch.Generator().manual_seed(4))
    chunker = Chunker(64, ChunkHasher(), CacheKey("m", 1, 0, "bfloat16", b""))
    here = chunker.chunks(
        list(range(300)),
        extras=RequestExtras(prompt_embeds=PromptEmbeds(rows)),
        include_partial=True,
    )
    assert lines[4].split()[2] == ",".join(str(c.key) for c in here)


def engine_config(*, prefix_caching: bool, processor_cache_gb: float | None):
    """The parts of vLLM's config ``mm_identifier_scope`` reads (None: not multimodal)."""
    mm = (
        None
        if processor_cache_gb is None
        else SimpleNamespace(mm_processor_cache_gb=processor_cache_gb)
    )
    return SimpleNamespace(
        model_config=SimpleNamespace(multimodal_config=mm),
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
    )


@pytest.mark.parametrize(
    ("prefix_caching", "processor_cache_gb", "scoped"),
    [(True, 0, False), (False, 4, False), (False, None, False), (False, 0, True)],
)
def test_mm_identifiers_are_scoped_where_vllm_names_items_per_process(
    prefix_caching, processor_cache_gb, scoped
):
    config = engine_config(prefix_caching=prefix_caching, processor_cache_gb=processor_cache_gb)
    scopes = {facts.mm_identifier_scope(config) for _ in range(2)}
    assert (None not in scopes) == scoped
    if scoped:
        assert len(scopes) == 2, "two engines got the same scope"


def test_per_process_mm_names_never_share_across_engines():
    """Without prefix caching and the processor cache, vLLM names the first image of every
    process ``renderer0-mm-1-image-0``: another engine's image of that name is another
    image, so only the chunk before it is shared."""
    held = HeldHashes()
    config = engine_config(prefix_caching=False, processor_cache_gb=0)
    first, second = make_side(held), make_side(held)
    first.extras_of, second.extras_of = facts.extras_reader(config), facts.extras_reader(config)
    feature = FakeMMFeature("renderer0-mm-1-image-0", FakePosition(64, 128))

    def request(req_id: str) -> FakeRequest:
        return FakeRequest(req_id, [7] * 300, 300, mm_features=[feature])

    held.hold(saved_hashes(first, request("one")))
    assert second.get_num_new_matched_tokens(request("two"), 0) == (CHUNK, False)
    assert first.get_num_new_matched_tokens(request("three"), 0) == (4 * CHUNK, False)


def test_vllm_has_the_settings_mm_identifier_scope_reads():
    config = pytest.importorskip("vllm.config")
    assert "mm_processor_cache_gb" in config.MultiModalConfig.__dataclass_fields__
    assert "enable_prefix_caching" in config.CacheConfig.__dataclass_fields__
    assert "multimodal_config" in config.ModelConfig.__dataclass_fields__
