"""Cache-aware routing with real engines: two ``kv_both`` vLLM OpenAI servers (CPU build),
each with its own kvtier CPU tier and KV event stream, behind ``kvtier proxy --policy
cache_aware`` (``support.routing``). The engines start once for the module; the tests
run in order on them:

- a subscriber that decodes an engine's ZMQ stream with vLLM's own classes computes, with
  ``kvtier.hashing`` and the engines' ``PYTHONHASHSEED``, the very block hashes that vLLM's
  prefix-cache events (``medium: GPU``) and kvtier's tier events (``ownership: kvtier``,
  ``medium: CPU``) carry for a prompt;
- a repeated system prompt goes back to the instance that holds it: the proxy's
  decisions, its predicted cached tokens, the answer's ``cached_tokens`` and the engines'
  own prefix-cache hits agree;
- a restarted proxy rebuilds its index from the engines' replay sockets (once each
  engine publishes its next batch: an idle engine publishes nothing);
- an instance killed (SIGKILL) is routed around, and once restarted gets requests again
  by its cache, and is not credited with the blocks it lost (its stream reconnecting
  drops its entries until its new batches, replayed from 0, rebuild them);
- a prefix-cache reset (``AllBlocksCleared``) takes the instance's GPU blocks out of the
  index, kvtier's CPU tier still routes there; resetting kvtier too takes the rest.

The proxy's prediction is checked against the engine on every request:
``kvtier_proxy_predicted_cached_tokens_total`` grows by what the answer's
``usage.prompt_tokens_details.cached_tokens`` reports.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import pytest
from conftest import BLOCK, CHUNK
from support.event_stream import EventStream
from support.models import add_word_tokenizer, make_tiny_llama
from support.routing import (
    HASH_SEED,
    ProxyProcess,
    RoutedInstance,
    cache_aware_flags,
    chat,
    samples,
    shared_prefix_workload,
    word_prompts,
    words,
)
from support.vllm_openai import http, metric, post_json

from kvtier.hashing import ChunkHasher

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

KVTIER = {"chunk_size": CHUNK, "max_local_cpu_size": 0.25}
SYSTEM_WORDS = 190  # with "system" and "user": 192 tokens every question shares, 6 blocks
SHARED = SYSTEM_WORDS + 2
PROMPTS, QUESTIONS = 4, 4
DECISIONS = "kvtier_proxy_route_decisions_total"
PREDICTED = "kvtier_proxy_predicted_cached_tokens_total"
ACTUAL = "kvtier_proxy_actual_cached_tokens_total"
RECEIVED = "kvtier_proxy_kv_events_received_total"
GPU_HITS = "vllm:prefix_cache_hits_total"
CPU_HITS = "vllm:external_prefix_cache_hits_total"
DONE = "vllm:request_success_total"


class Deployment:
    def __init__(self, tmp_path_factory):
        model_dir = tmp_path_factory.mktemp("models") / "llama-chat"
        self.model = str(add_word_tokenizer(make_tiny_llama(model_dir)))
        self.logs = tmp_path_factory.mktemp("routing-logs")
        self.instances = [
            RoutedInstance(model_dir, self.logs / f"engine-{i}.log", KVTIER, block_size=BLOCK)
            for i in range(2)
        ]
        self.proxy: ProxyProcess | None = None
        for instance in self.instances:
            instance.server.wait_healthy()
        # (prompt index, system, question), every system prompt asked QUESTIONS times
        self.workload = shared_prefix_workload(
            PROMPTS, QUESTIONS, system_words=SYSTEM_WORDS, question_words=40, seed=31
        )
        self.systems = sorted({(i, system) for i, system, _ in self.workload})
        self.holder: dict[int, str] = {}  # prompt index -> the URL of the instance holding it
        self.victim: RoutedInstance | None = None  # the instance killed and restarted
        self.probe = ""  # a system prompt only the victim held before it was killed

    def start_proxy(self) -> ProxyProcess:
        self.proxy = ProxyProcess(cache_aware_flags(self.instances), self.logs / "proxy.log")
        return self.proxy

    def by_url(self, url: str) -> RoutedInstance:
        return next(i for i in self.instances if i.url == url)

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
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


@pytest.fixture(scope="module")
def routed(deployment) -> Deployment:
    """The deployment with its proxy; each system prompt asked once through it."""
    deployment.start_proxy()
    for i, system in deployment.systems:
        answer = send(deployment, chat(deployment.model, system, f"w{100 + i} w7"))
        assert answer.predicted == answer.actual == answer.cached == 0, answer
        deployment.holder[i] = answer.instance
    return deployment


@dataclass
class Answer:
    instance: str | None  # the instance the proxy picked, if it picked once
    served: str | None  # the engine that answered (a retry after a failure picks again)
    picks: dict[str, float]  # decisions per instance
    cached: int  # the answer's usage.prompt_tokens_details.cached_tokens
    predicted: float  # the proxy's predicted cached tokens
    actual: float  # cached tokens the proxy read from the answer
    gpu_hits: dict[str, float]  # each engine's own prefix-cache hits (tokens)
    cpu_hits: dict[str, float]  # each engine's external (kvtier) hits (tokens)


def snapshot(deployment: Deployment) -> dict:
    text = deployment.proxy.metrics_text()
    engines = {}
    for instance in deployment.instances:
        if instance.server.process.poll() is None:
            with contextlib.suppress(OSError):  # starting
                engine = http(instance.url + "/metrics").decode()
                engines[instance.url] = [metric(engine, m) for m in (GPU_HITS, CPU_HITS, DONE)]
    return {
        "picks": samples(text, DECISIONS, "instance"),
        "predicted": metric(text, PREDICTED),
        "actual": metric(text, ACTUAL),
        "received": metric(text, RECEIVED),
        "engines": engines,
    }


def settle(deployment: Deployment, quiet: float = 0.5, timeout: float = 15) -> None:
    """Wait until the proxy has received no event for ``quiet`` seconds: an engine
    publishes a step's events as it ends, kvtier's a step or two later."""
    deadline = time.monotonic() + timeout
    received, since = None, time.monotonic()
    while time.monotonic() < deadline:
        now = metric(deployment.proxy.metrics_text(), RECEIVED)
        if now != received:
            received, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        time.sleep(0.1)


def send(deployment: Deployment, body: dict) -> Answer:
    """POST a chat request through the proxy; what the proxy and the engines counted."""
    before = snapshot(deployment)
    answer = post_json(deployment.proxy.url + "/v1/chat/completions", body)
    settle(deployment)
    after = snapshot(deployment)
    picks = {
        url: n - before["picks"].get(url, 0)
        for url, n in after["picks"].items()
        if n > before["picks"].get(url, 0)
    }
    engines = {
        url: [a - before["engines"].get(url, (0, 0, 0))[k] for k, a in enumerate(counts)]
        for url, counts in after["engines"].items()
    }
    (served,) = [url for url, counts in engines.items() if counts[2]] or [None]
    details = answer["usage"].get("prompt_tokens_details") or {}
    return Answer(
        instance=next(iter(picks)) if len(picks) == 1 else None,
        served=served,
        picks=picks,
        cached=int(details.get("cached_tokens") or 0),
        predicted=after["predicted"] - before["predicted"],
        actual=after["actual"] - before["actual"],
        gpu_hits={url: hits[0] for url, hits in engines.items()},
        cpu_hits={url: hits[1] for url, hits in engines.items()},
    )


def poke(instance: RoutedInstance, model: str, tokens: list[int] | None = None) -> None:
    """A request straight to the engine: one step, which publishes what the engine queued
    while idle (a reset's events) and what ``tokens`` store (default: a prompt shorter
    than a block, which stores nothing)."""
    body = {"model": model, "prompt": tokens or [7] * 5, "max_tokens": 1}
    post_json(instance.url + "/v1/completions", body)


def wait_for(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def stream_of(deployment: Deployment, url: str) -> dict:
    health = deployment.proxy.health()
    (row,) = [r for r in health["decode"] if r["url"] == url]
    return row


# -- the events themselves -------------------------------------------------------------


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


# -- routing -------------------------------------------------------------------------


def test_a_repeated_system_prompt_goes_back_to_the_instance_that_holds_it(routed):
    assert set(routed.holder.values()) == {i.url for i in routed.instances}, (
        "new system prompts went to one instance: ties go to the least loaded, then the "
        "least recently picked"
    )
    for i, system, question in routed.workload:
        answer = send(routed, chat(routed.model, system, question))
        holder = routed.holder[i]
        assert answer.instance == holder, f"system prompt {i}: {answer}"
        assert answer.predicted == answer.actual == answer.cached == SHARED, answer
        # The engine's own prefix cache served it; the other engine saw nothing.
        assert answer.gpu_hits == {
            url: SHARED if url == holder else 0 for url in answer.gpu_hits
        }, answer


def test_a_restarted_proxy_rebuilds_its_index_from_the_engines(routed):
    blocks = {i.url: stream_of(routed, i.url)["kv_events"]["blocks"] for i in routed.instances}
    assert all(blocks.values()), blocks
    routed.proxy.restart()
    for instance in routed.instances:
        wait_for(
            lambda url=instance.url: stream_of(routed, url)["kv_events"]["state"] == "connected",
            f"the restarted proxy to connect to {instance.url}'s events",
        )
    # An engine's next batch shows the new proxy where its stream stands: it asks the
    # replay socket for the engine's history from seq 0. A new block makes one.
    new_blocks = word_prompts([BLOCK + 1] * 2, seed=3200)
    for instance, tokens in zip(routed.instances, new_blocks, strict=True):
        poke(instance, routed.model, tokens)
    settle(routed)
    for instance in routed.instances:
        row = stream_of(routed, instance.url)["kv_events"]
        assert row["blocks"] == blocks[instance.url] + 1, (instance.url, row)
    for i, system in routed.systems:
        answer = send(routed, chat(routed.model, system, f"w{200 + i} w8"))
        assert answer.instance == routed.holder[i], answer
        assert answer.predicted == answer.actual == SHARED, answer


def test_a_killed_instance_is_routed_around(routed):
    victim = routed.by_url(routed.holder[routed.systems[1][0]])
    (survivor,) = [i for i in routed.instances if i is not victim]
    lost = [(i, system) for i, system in routed.systems if routed.holder[i] == victim.url]
    assert len(lost) >= 2, lost
    routed.victim, routed.probe = victim, lost[1][1]
    victim.server.kill()
    wait_for(
        lambda: stream_of(routed, victim.url)["kv_events"]["state"] == "disconnected",
        "the proxy to see the victim's event stream disconnected",
    )
    # A prefix the victim held, and a new one: answered by the survivor (the proxy may
    # try the victim first, finding it down).
    i, system = lost[0]
    (fresh,) = word_prompts([SYSTEM_WORDS], seed=3300)
    for body in (chat(routed.model, system, "w300 w9"), chat(routed.model, words(fresh), "w9")):
        answer = send(routed, body)
        assert answer.served == survivor.url, answer
        assert answer.predicted == answer.actual == 0, answer
    routed.holder[i] = survivor.url
    for k, system_k in routed.systems:
        if routed.holder[k] == survivor.url:
            answer = send(routed, chat(routed.model, system_k, "w301 w9"))
            assert answer.instance == survivor.url, answer
            assert answer.predicted == answer.actual == SHARED, answer

    victim.server.start()
    victim.server.wait_healthy()
    wait_for(
        lambda: (
            stream_of(routed, victim.url)["up"]
            and stream_of(routed, victim.url)["kv_events"]["state"] == "connected"
        ),
        "the proxy to take the restarted instance back",
    )


def test_a_restarted_instance_is_not_credited_with_the_blocks_it_lost(routed):
    # Before the restarted engine's first event: nobody holds the probe's prefix now
    # (the victim lost its caches, the survivor never saw it).
    answer = send(routed, chat(routed.model, routed.probe, "w302 w9"))
    assert answer.predicted == answer.actual == 0, answer


def test_a_restarted_instance_gets_requests_again(routed):
    (survivor,) = [i for i in routed.instances if i is not routed.victim]
    # New prefixes: ties go to the least loaded, then the least recently picked.
    fresh = [words(p) for p in word_prompts([SYSTEM_WORDS] * 2, seed=3400)]
    servers = [send(routed, chat(routed.model, system, "w9")).instance for system in fresh]
    assert sorted(servers) == sorted([routed.victim.url, survivor.url]), servers
    for system, server in zip(fresh, servers, strict=True):
        answer = send(routed, chat(routed.model, system, "w304 w9"))
        assert answer.instance == server, answer
        assert answer.predicted == answer.actual == SHARED, answer


def test_a_prefix_cache_reset_takes_the_instances_blocks_out_of_the_index(routed):
    url = routed.holder[routed.systems[0][0]]
    instance = routed.by_url(url)
    held = [(i, system) for i, system in routed.systems if routed.holder[i] == url]
    blocks = stream_of(routed, url)["kv_events"]["blocks"]
    # vLLM's prefix cache only: AllBlocksCleared (published with the engine's next step)
    # takes its GPU blocks out; kvtier's CPU tier still holds every whole chunk.
    instance.server.reset_prefix_cache()
    poke(instance, routed.model)
    settle(routed)
    left = stream_of(routed, url)["kv_events"]["blocks"]
    assert 0 < left < blocks, (blocks, left)
    (i, system) = held[0]
    answer = send(routed, chat(routed.model, system, "w400 w9"))
    assert answer.instance == url, answer
    assert answer.predicted == answer.actual == SHARED, answer
    assert (answer.gpu_hits[url], answer.cpu_hits[url]) == (0, SHARED), answer
    # kvtier's tier too (BlockRemoved): the instance holds nothing.
    instance.server.reset_prefix_cache(external=True)
    poke(instance, routed.model)
    settle(routed)
    assert stream_of(routed, url)["kv_events"]["blocks"] == 0
    for i, system in held:
        answer = send(routed, chat(routed.model, system, f"w{410 + i} w9"))
        assert answer.predicted == answer.actual == 0, answer
