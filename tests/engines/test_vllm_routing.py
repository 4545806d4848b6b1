"""Cache-aware routing with real engines: two ``kv_both`` vLLM OpenAI servers (CPU build),
each with its own kvtier CPU tier and KV event stream, behind ``kvtier proxy --policy
cache_aware``.

- a subscriber that decodes an engine's ZMQ stream with vLLM's own classes computes, with
  ``kvtier.hashing`` and the engines' ``PYTHONHASHSEED``, the very block hashes that vLLM's
  prefix-cache events (``medium: GPU``) and kvtier's tier events (``ownership: kvtier``,
  ``medium: CPU``) carry for a prompt;
"""

from __future__ import annotations

import time

import pytest
from conftest import BLOCK, CHUNK
from support.engines import prompts_of
from support.event_stream import EventStream
from support.models import add_word_tokenizer, make_tiny_llama
from support.routing import HASH_SEED, RoutedInstance
from support.vllm_openai import post_json

from kvtier.hashing import ChunkHasher

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

KVTIER = {"chunk_size": CHUNK, "max_local_cpu_size": 0.25}
# Plain words of the test tokenizer (ids 0-5 are special tokens and role names).
FIRST_WORD = 6


class Deployment:
    def __init__(self, tmp_path_factory):
        model_dir = tmp_path_factory.mktemp("models") / "llama-chat"
        self.model = str(add_word_tokenizer(make_tiny_llama(model_dir)))
        self.logs = tmp_path_factory.mktemp("routing-logs")
        self.instances = [
            RoutedInstance(model_dir, self.logs / f"engine-{i}.log", KVTIER, block_size=BLOCK)
            for i in range(2)
        ]
        for instance in self.instances:
            instance.server.wait_healthy()

    def close(self) -> None:
        for instance in self.instances:
            instance.server.close()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    pytest.importorskip("vllm")
    deployment = Deployment(tmp_path_factory)
    try:
        yield deployment
    finally:
        deployment.close()


def word_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    return [[FIRST_WORD + t for t in p] for p in prompts_of(lengths, seed=seed, vocab=500)]


def block_hashes(prompt: list[int], seed: str, cache_salt: str | None = None) -> list:
    """vLLM's block hashes of the prompt's whole blocks, computed by kvtier's hasher, as
    vLLM's events carry them (by default the low 64 bits as an int:
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    blocks = [prompt[i : i + BLOCK] for i in range(0, len(prompt) // BLOCK * BLOCK, BLOCK)]
    extras = [None] * len(blocks)
    if cache_salt:
        extras[0] = (("cache_salt", cache_salt),)
    hashes = ChunkHasher("sha256_cbor", seed).chain(blocks, extras)
    return [maybe_convert_block_hash(h) for h in hashes]


def stored(events: list, ownership: str | None) -> list:
    from vllm.distributed.kv_events import BlockStored

    return [e for e in events if isinstance(e, BlockStored) and e.ownership == ownership]


def chained(events: list) -> list:
    """The block hashes of consecutive ``BlockStored`` events, checked to chain on each
    other (each event's parent is the previous event's last block)."""
    hashes: list = []
    for e in events:
        assert e.parent_block_hash == (hashes[-1] if hashes else None), "events out of order"
        hashes += e.block_hashes
    return hashes


@pytest.mark.parametrize("cache_salt", [None, "tenant-a"])
def test_vllms_event_classes_see_the_block_hashes_kvtier_computes(deployment, cache_salt):
    instance = deployment.instances[0]
    (prompt,) = word_prompts([300], seed=3100 + bool(cache_salt))
    stream = EventStream(instance.events_endpoint)
    try:
        time.sleep(1.0)  # the subscription reaches the publisher (ZMQ's slow joiner)
        body = {"model": deployment.model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        if cache_salt:
            body["cache_salt"] = cache_salt
        answer = post_json(instance.url + "/v1/completions", body)
        assert answer["usage"]["prompt_tokens"] == len(prompt)
        events = stream.take(quiet=2.0)
    finally:
        stream.close()
    want = block_hashes(prompt, HASH_SEED, cache_salt)
    assert len(want) == len(prompt) // BLOCK == 9
    # vLLM's prefix cache: every whole block of the prompt (prompt and output end in block 9).
    gpu = stored(events, None)
    assert {e.medium for e in gpu} == {"GPU"}, [e.medium for e in gpu]
    assert chained(gpu) == want
    # kvtier's CPU tier: every whole chunk, as the vLLM blocks it covers.
    ours = stored(events, "kvtier")
    assert {(e.medium, e.locality) for e in ours} == {("CPU", "LOCAL")}
    assert chained(ours) == want[: len(prompt) // CHUNK * CHUNK // BLOCK]
    for e in ours:
        first = want.index(e.block_hashes[0])
        assert e.token_ids == prompt[first * BLOCK : (first + len(e.block_hashes)) * BLOCK]
    # The seed matters: vLLM's default seed gives other hashes, which no event carries.
    assert not set(block_hashes(prompt, "vllm-none-hash", cache_salt)) & set(chained(gpu))
