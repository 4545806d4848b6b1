"""Disaggregated prefill with real vLLM engines (CPU build), each in a process of its own:
a ``kv_producer`` computes prompts and stores their KV, a ``kv_consumer`` loads it and
generates. Once through a ``kvtier serve`` (failure policy "recompute", no wait), once
through Redis (policy "fail", ``pd_wait_ms``).

- for prompts shorter than a chunk, of exact multiples and long, the consumer's output
  equals an engine's without any connector, and it computed only what it must: every
  whole block of the prompt but the one holding its last token was loaded (partial last
  chunks included: producers store them by default);
- the producer's response means its store is done: the consumer starts right after it
  and hits; with ``pd_wait_ms`` a consumer that starts first waits for it;
- a producer never loads, a consumer never stores;
- a prompt no producer served is recomputed; a corrupt stored chunk is recomputed, or,
  with ``kv_load_failure_policy: fail``, fails that request and only that one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import BLOCK, CHUNK
from support.engine_process import EngineProcess
from support.engines import expected_loaded, prompts_of
from support.kvtier_server import KVTierServerProcess
from support.redis_server import RedisServer, redis_available

from kvtier.storage.node_store import KVTierStore
from kvtier.storage.redis_store import RedisStore
from kvtier.storage.remote import space_of

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

PD_WAIT_MS = 6000


@dataclass
class Flavour:
    store: str  # "kvtier" or "redis"
    policy: str  # the consumer's kv_load_failure_policy
    pd_wait_ms: int


FLAVOURS = [Flavour("kvtier", "recompute", 0), Flavour("redis", "fail", PD_WAIT_MS)]


class Deployment:
    """A store, a producer and a consumer."""

    def __init__(self, flavour: Flavour, model: Path, log_dir: Path):
        self.flavour = flavour
        self.model = model
        if flavour.store == "kvtier":
            self.server = KVTierServerProcess("--chunk-size", str(CHUNK))
        else:
            self.server = RedisServer()
        extra = {
            "chunk_size": CHUNK,
            "local_cpu": False,
            "max_local_cpu_size": 0.25,
            "remote_url": self.server.url,
            "remote_timeout_ms": 2000,
        }
        stamp = int(time.time() * 1000) % 10**8
        self.producer = EngineProcess(
            model,
            f"kvtier-pd-producer-{stamp}",
            extra,
            log_dir / f"producer-{flavour.store}.log",
            kv_role="kv_producer",
        )
        consumer_extra = {
            **extra,
            "kv_load_failure_policy": flavour.policy,
            "pd_wait_ms": flavour.pd_wait_ms,
        }
        self.consumer = EngineProcess(
            model,
            f"kvtier-pd-consumer-{stamp}",
            consumer_extra,
            log_dir / f"consumer-{flavour.store}.log",
            kv_role="kv_consumer",
            in_process=True,
        )
        self.producer.wait_ready()
        self.consumer.wait_ready()

    def store_client(self) -> KVTierStore | RedisStore:
        """A client of the store, in the engines' namespace for this model."""
        space = space_of(str(self.model))
        if self.flavour.store == "kvtier":
            return KVTierStore("127.0.0.1", self.server.port, namespace=space)
        return RedisStore(self.server.url, namespace=f"kvtier:{space}:")

    def close(self) -> None:
        self.producer.close()
        self.consumer.close()
        self.server.close()


@pytest.fixture(scope="module", params=FLAVOURS, ids=lambda f: f"{f.store}-{f.policy}")
def pd(request, model_a, tmp_path_factory):
    if request.param.store == "redis" and not redis_available():
        pytest.skip("redis-server is not installed")
    deployment = Deployment(request.param, model_a, tmp_path_factory.mktemp("pd-logs"))
    try:
        yield deployment
    finally:
        deployment.close()


def loaded_by_consumer(prompt: list[int]) -> int:
    return expected_loaded(len(prompt), chunk_size=CHUNK, block_size=BLOCK, partial=True)


def counter(engine: EngineProcess, name: str) -> float:
    return engine.call("stats").get(name, 0)


def test_consumer_loads_what_the_producer_just_stored(pd, prompts_a, reference_a):
    prefilled, _ = pd.producer.generate(prompts_a, max_tokens=1)
    assert [cached for _, cached in prefilled] == [0] * len(prompts_a)
    # no waiting for the store: the producer's response means it is done
    results, _ = pd.consumer.generate(prompts_a)
    for i, ((ids, cached), want, prompt) in enumerate(
        zip(results, reference_a["single"], prompts_a, strict=True)
    ):
        assert ids == want.token_ids, f"prompt {i} ({len(prompt)} tokens): output differs"
        assert cached == loaded_by_consumer(prompt), (
            f"prompt {i} ({len(prompt)} tokens): the consumer did not compute {cached} "
            f"tokens, expected {loaded_by_consumer(prompt)} loaded"
        )
    assert counter(pd.consumer, "retrieve_hit_tokens") >= sum(map(loaded_by_consumer, prompts_a))
    assert counter(pd.consumer, "stored_chunks") == 0, "a kv_consumer stored chunks"
    assert counter(pd.producer, "stored_chunks") > 0

    pd.producer.call("reset")  # vLLM's own prefix cache emptied: only kvtier could hit
    again, _ = pd.producer.generate(prompts_a[:2], max_tokens=1)
    assert [cached for _, cached in again] == [0, 0], "a kv_producer loaded"
    assert counter(pd.producer, "retrieve_requests") == 0


def test_a_prompt_no_producer_served_is_recomputed(pd, shared_prefix_prompts, reference_a):
    hits = counter(pd.consumer, "retrieve_hit_tokens")
    results, seconds = pd.consumer.generate(shared_prefix_prompts)
    assert [ids for ids, _ in results] == [r.token_ids for r in reference_a["shared"]]
    assert counter(pd.consumer, "retrieve_hit_tokens") == hits
    if pd.flavour.pd_wait_ms:  # it waited for a producer, then gave up
        assert seconds >= pd.flavour.pd_wait_ms / 1000


def test_a_consumer_that_starts_first_waits_for_the_producer(pd):
    if not pd.flavour.pd_wait_ms:
        pytest.skip("this deployment's consumer does not wait (pd_wait_ms: 0)")
    (prompt,) = prompts_of([200], seed=21)
    pd.consumer.send("generate", prompts=[prompt], max_tokens=8)
    time.sleep(1.0)  # the consumer looks first, finds nothing, and waits
    pd.producer.generate([prompt], max_tokens=1)
    (result,), _ = pd.consumer.reply_to_generate()
    assert result[1] == loaded_by_consumer(prompt), (
        f"the waiting consumer loaded {result[1]} tokens, expected "
        f"{loaded_by_consumer(prompt)} once the producer stored them"
    )


def corrupt(deployment: Deployment, name: str) -> None:
    """Flip bytes in the middle of a stored chunk (its wire checksum no longer holds)."""
    store = deployment.store_client()
    try:
        (blob,) = store.get_many([name])
        assert blob is not None, f"chunk {name} is not in the store"
        damaged = bytearray(blob)
        middle = len(damaged) // 2
        damaged[middle : middle + 16] = bytes(b ^ 0x5A for b in damaged[middle : middle + 16])
        store.delete_many([name])
        store.put_many([(name, [bytes(damaged)])])
    finally:
        store.close()


def test_a_corrupt_chunk_is_recomputed_or_fails_only_its_request(pd, prompts_a, reference_a):
    """prompts_a[3] (300 tokens) has its first chunk corrupted; prompts_a[4] is intact."""
    bad, good = prompts_a[3], prompts_a[4]
    pd.producer.generate([bad, good], max_tokens=1)  # stored (again: a no-op)
    pd.consumer.call("reset")  # vLLM's own prefix cache emptied: loads come from kvtier
    (first_chunk, *_) = pd.consumer.call("chunk_names", prompt=bad)["names"]
    corrupt(pd, first_chunk)
    rejected = counter(pd.consumer, "corrupt_chunks_rejected")
    results, _ = pd.consumer.generate([bad, good], finish=True)
    (bad_ids, _, bad_reason), (good_ids, good_cached, good_reason) = results
    assert counter(pd.consumer, "corrupt_chunks_rejected") > rejected
    assert good_ids == reference_a["single"][4].token_ids and good_reason == "length"
    assert good_cached == loaded_by_consumer(good)
    if pd.flavour.policy == "recompute":
        assert bad_ids == reference_a["single"][3].token_ids and bad_reason == "length"
    else:
        assert bad_reason == "error", f"kv_load_failure_policy 'fail': finished {bad_reason!r}"
    # the engine still serves the request correctly once the chunk is stored again
    pd.producer.call("reset")
    corrupt_again = pd.store_client()
    corrupt_again.delete_many([first_chunk])
    corrupt_again.close()
    pd.producer.generate([bad], max_tokens=1)
    pd.consumer.call("reset")
    (again,), _ = pd.consumer.generate([bad])
    assert again == (reference_a["single"][3].token_ids, loaded_by_consumer(bad))
