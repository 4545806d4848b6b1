"""``kvtier proxy --policy cache_aware`` end to end with fake engines: each answers
``/tokenize`` (its token ids are the prompt's bytes) and publishes KV events on a ZMQ
socket of its own (``support.kv_events_fake``). Decisions follow the cache, ties and
empty matches go to the least loaded instance, a down instance and a disconnected stream
are skipped, PD mode scores the prefill pool, and the metrics and /health fields.
"""

from __future__ import annotations

import contextlib
import http.client
import threading
import time
from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("msgspec")
pytest.importorskip("zmq")

from support.kv_events_fake import FakeKVEvents, free_port
from support.openai_fakes import AppThread, Behaviour, FakeOpenAI, fake_tokens
from test_proxy import get_json, metric, post, wait_until

from kvtier.cli import main
from kvtier.proxy import cache_aware
from kvtier.proxy.app import Proxy, ProxySettings
from kvtier.proxy.cache_aware import RoutingSettings
from kvtier.routing.block_hashes import RequestKeys, VllmBlockHasher

pytestmark = pytest.mark.timeout(60)

BLOCK = 4
SYSTEM = "You are a helpful assistant. " * 4  # 116 bytes: 29 blocks of 4 "tokens"
SYSTEM_BLOCKS = 29
CHAT = "/v1/chat/completions"


def completion(prompt: str, **extra) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": 5, **extra}


def block_keys(prompt: str, salt: str | None = None) -> list[int]:
    tokens = fake_tokens({"prompt": prompt})
    return VllmBlockHasher("sha256_cbor").block_keys(tokens, BLOCK, RequestKeys(salt))


class Engine:
    """A fake engine and its event stream."""

    def __init__(self, name: str, **behaviour):
        self.http = FakeOpenAI(name, Behaviour(**behaviour)).start()
        self.events = FakeKVEvents()
        self.url = self.http.url

    def holds(self, prompt: str, medium: str = "GPU", locality: str | None = None, salt=None):
        self.events.stored(block_keys(prompt, salt), medium, locality, BLOCK)

    def completions(self) -> list:
        return [r for r in self.http.received if r.path == "/v1/completions"]

    def close(self) -> None:
        self.http.close()
        self.events.close()


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    started: list[Engine] = []

    def make(name: str, **behaviour) -> Engine:
        engine = Engine(name, **behaviour)
        started.append(engine)
        return engine

    yield make
    for engine in started:
        engine.close()


@pytest.fixture
def proxy() -> Iterator[Callable[..., AppThread]]:
    running: list[AppThread] = []

    def make(decode: list[Engine], prefill: list[Engine] = (), **routing) -> AppThread:
        streams = {e.url: e.events.endpoint for e in (*prefill, *decode)}
        routing.setdefault("hash_algo", "sha256_cbor")  # the fake engines' hashing
        settings = ProxySettings(
            prefill=tuple(e.url for e in prefill),
            decode=tuple(e.url for e in decode),
            policy="cache_aware",
            routing=RoutingSettings(kv_events=routing.pop("kv_events", streams), **routing),
        )
        instance = Proxy(settings)
        thread = AppThread(instance.build_app()).start()
        thread.proxy = instance
        running.append(thread)
        scored = prefill or decode
        router = instance.routing
        subscribers = [router.subscribers[e.url] for e in scored if e.url in router.subscribers]
        wait_until(lambda: all(s.connected for s in subscribers))
        return thread

    yield make
    for thread in running:
        thread.close()


def publish_and_wait(server: AppThread, engine: Engine, prompt: str, **kwargs) -> None:
    """``engine`` announces ``prompt``'s blocks; wait until the proxy has them (the
    first announcement after a subscription may be lost: ZMQ's slow joiner)."""
    router = server.proxy.routing
    want = set(block_keys(prompt, kwargs.get("salt")))
    number = router.index.instances[engine.url].number

    def indexed() -> bool:
        return all(number in (router.index.holders(k) or {}) for k in want)

    for _ in range(50):
        engine.holds(prompt, **kwargs)
        try:
            wait_until(indexed, timeout=0.1)
            return
        except AssertionError:
            continue
    raise AssertionError("the proxy never indexed the blocks")


def test_requests_go_where_their_prefix_is_cached(engines, proxy):
    a, b = engines("a"), engines("b")
    server = proxy([a, b])
    publish_and_wait(server, b, SYSTEM + "Q1")
    for question in ("Q1", "Q2", "Q3"):
        assert post(server.url, "/v1/completions", completion(SYSTEM + question))[0] == 200
    assert len(b.completions()) == 3 and not a.completions()
    assert b.http.received[0].path == "/tokenize", "tokenized on an instance of the pool"
    assert (
        metric(server.url, "kvtier_proxy_route_decisions_total", instance=b.url, role="decode") == 3
    )
    assert metric(server.url, "kvtier_proxy_route_matched_blocks_count") == 3
    assert metric(server.url, "kvtier_proxy_route_matched_blocks_sum") == 3 * SYSTEM_BLOCKS
    assert (
        metric(server.url, "kvtier_proxy_predicted_cached_tokens_total")
        == 3 * SYSTEM_BLOCKS * BLOCK
    )
    assert metric(server.url, "kvtier_proxy_route_seconds_count") >= 3
    prompts = [r.body for r in b.http.received if r.path == "/tokenize"]
    assert prompts[0] == {"model": "m", "prompt": SYSTEM + "Q1", "add_special_tokens": True}
    assert len(prompts) + len(a.http.received) == 3, "one /tokenize per prompt text"
    post(server.url, "/v1/completions", completion(SYSTEM + "Q1"))
    assert len(prompts) + len(a.http.received) == 3 + 0, "the second time from the cache"


def test_requests_the_engine_will_refuse_are_passed_on_unscored(engines, proxy):
    """Fields the engine validates (token ids out of range, a model that is no string, a
    chat_template_kwargs that is no object) make the request unscorable, not a 500 from
    the proxy: the engine gives the verdict."""
    a, b = engines("a"), engines("b")
    server = proxy([a, b])
    publish_and_wait(server, b, SYSTEM)
    ids = list(SYSTEM.encode())
    chat = {"messages": [{"role": "user", "content": SYSTEM}], "reasoning_effort": "low"}
    for path, body in [
        ("/v1/completions", completion([*ids[:-1], 1 << 70])),
        ("/v1/completions", completion([*ids[:-1], -1])),
        ("/v1/completions", {**completion(ids), "model": ["m"]}),
        ("/v1/completions", {**completion(SYSTEM), "model": {"name": "m"}}),
        ("/v1/chat/completions", {**chat, "model": "m", "chat_template_kwargs": "x"}),
        ("/v1/chat/completions", {**chat, "model": ["m"], "chat_template_kwargs": [1]}),
        # JSON may escape a lone surrogate, which no UTF-8 (nor CBOR) can encode
        ("/v1/completions", completion(SYSTEM, cache_salt="\ud800")),
    ]:
        status, _, answer = post(server.url, path, body)
        assert status == 200, (body, answer)
    assert len(a.completions()) + len(b.completions()) == 5
    assert metric(server.url, "kvtier_proxy_requests_total", endpoint=CHAT, status="200") == 2


def test_a_better_medium_wins_and_a_salt_separates(engines, proxy):
    a, b = engines("a"), engines("b")
    server = proxy([a, b])
    publish_and_wait(server, a, SYSTEM, medium="STORAGE", locality="LOCAL")
    publish_and_wait(server, b, SYSTEM, medium="CPU", locality="LOCAL")
    post(server.url, "/v1/completions", completion(SYSTEM + "Q"))
    assert len(b.completions()) == 1
    publish_and_wait(server, a, SYSTEM, salt="t1")
    post(server.url, "/v1/completions", completion(SYSTEM + "Q", cache_salt="t1"))
    assert len(a.completions()) == 1, "only a holds the salted prefix"


def test_ties_and_empty_matches_go_to_the_least_loaded(engines, proxy):
    slow, fast = engines("slow", delay_s=0.4), engines("fast")
    server = proxy([slow, fast])
    publish_and_wait(server, slow, SYSTEM)
    publish_and_wait(server, fast, SYSTEM)
    busy = threading.Thread(target=post, args=(server.url, "/v1/completions", completion("x" * 40)))
    busy.start()
    wait_until(lambda: slow.http.in_flight == 1 or fast.http.in_flight == 1)
    loaded = slow if slow.http.in_flight else fast
    other = fast if loaded is slow else slow
    post(server.url, "/v1/completions", completion(SYSTEM + "Q"))  # a tie: both hold it
    post(server.url, "/v1/completions", completion("nothing cached " * 3))
    busy.join()
    assert len(other.completions()) == 2 and len(loaded.completions()) == 1


def test_load_outweighs_a_small_cache_advantage(engines, proxy):
    a, b = engines("a", delay_s=0.5), engines("b")
    server = proxy([a, b], load_weight=1.0)
    publish_and_wait(server, a, SYSTEM)
    busy = threading.Thread(target=post, args=(server.url, "/v1/completions", completion(SYSTEM)))
    busy.start()
    wait_until(lambda: a.http.in_flight == 1)
    post(
        server.url, "/v1/completions", completion(SYSTEM + "Q")
    )  # at most 1.0 - 1.0: the tie goes to b
    busy.join()
    assert len(b.completions()) == 1


def test_a_down_instance_and_a_disconnected_stream_are_skipped(engines, proxy):
    a, b = engines("a"), engines("b")
    server = proxy([a, b], kv_events={a.url: a.events.endpoint, b.url: b.events.endpoint})
    publish_and_wait(server, a, SYSTEM)
    a.http.stop()
    assert post(server.url, "/v1/completions", completion(SYSTEM + "Q"))[0] == 200
    assert len(b.completions()) == 1
    assert metric(server.url, "kvtier_proxy_route_seconds_count") == 1, "one per request"
    assert metric(server.url, "kvtier_proxy_route_matched_blocks_count") == 1
    health = get_json(server.url, "/health")
    row = next(r for r in health["decode"] if r["url"] == a.url)
    assert row["up"] is False and row["kv_events"]["blocks"] == SYSTEM_BLOCKS, "entries kept"
    a.http.start()
    server.proxy.decode.mark_up(server.proxy.decode.instances[0])
    a.events.close()  # the stream goes away: a holds nothing until it is back
    router = server.proxy.routing
    wait_until(lambda: router.stream_state(a.url) == "disconnected")
    post(server.url, "/v1/completions", completion(SYSTEM + "Q2"))
    post(server.url, "/v1/completions", completion(SYSTEM + "Q3"))
    assert len(a.completions()) == 1 and len(b.completions()) == 2, "least loaded, in turn"


def test_a_stream_is_silent_only_when_no_event_follows_a_request(engines, proxy, monkeypatch):
    monkeypatch.setattr(cache_aware, "SILENT_AFTER_S", 0.2)
    a = engines("a", delay_s=0.5)
    server = proxy([a])
    router = server.proxy.routing
    publish_and_wait(server, a, "Earlier prompt. " * 2)  # the block size is known
    asked = threading.Thread(target=post, args=(server.url, "/v1/completions", completion(SYSTEM)))
    asked.start()
    wait_until(lambda: a.completions())
    publish_and_wait(server, a, SYSTEM)  # vLLM announces the blocks before it answers
    asked.join()
    time.sleep(0.4)
    assert router.stream_state(a.url) == "connected", "the request's event came"
    assert post(server.url, "/v1/completions", completion("Another prompt " * 4))[0] == 200
    time.sleep(0.4)
    assert router.stream_state(a.url) == "silent", "no event for the new blocks"


def test_a_stream_cut_before_its_end_is_no_answer(engines, proxy, monkeypatch):
    """A decode stream broken off after its usage chunk (before [DONE]) is recorded as
    504: neither its cached tokens count nor does its instance owe an event."""
    monkeypatch.setattr(cache_aware, "SILENT_AFTER_S", 0.2)
    a = engines("a", cached_tokens=32, chunks=2, cut_after=3)
    server = proxy([a])
    router = server.proxy.routing
    publish_and_wait(server, a, "Earlier prompt. " * 2)  # the block size is known
    body = {**completion(SYSTEM), "stream": True, "stream_options": {"include_usage": True}}
    with pytest.raises(http.client.IncompleteRead) as cut:
        post(server.url, "/v1/completions", body)
    assert b"cached_tokens" in cut.value.partial, "cut after the usage chunk"
    requests = {"endpoint": "/v1/completions", "status": "504"}
    wait_until(lambda: metric(server.url, "kvtier_proxy_requests_total", **requests) == 1)
    assert metric(server.url, "kvtier_proxy_actual_cached_tokens_total") == 0
    time.sleep(0.4)
    assert router.stream_state(a.url) == "connected"


def test_prefill_is_chosen_by_cache_and_decode_by_load(engines, proxy):
    p1, p2 = engines("p1"), engines("p2", cached_tokens=100)
    d1, d2 = engines("d1"), engines("d2")
    server = proxy([d1, d2], prefill=[p1, p2])
    publish_and_wait(server, p2, SYSTEM)
    for question in ("Q1", "Q2"):
        assert post(server.url, "/v1/completions", completion(SYSTEM + question))[0] == 200
    assert len(p2.completions()) == 2 and not p1.completions()
    assert len(d1.completions()) == len(d2.completions()) == 1
    assert metric(server.url, "kvtier_proxy_actual_cached_tokens_total") == 200
    labels = {"instance": p2.url, "role": "prefill"}
    assert metric(server.url, "kvtier_proxy_route_decisions_total", **labels) == 2


def test_health_and_metrics_show_each_stream(engines, proxy):
    a, b = engines("a", cached_tokens=32), engines("b")
    server = proxy([a, b], kv_events={a.url: a.events.endpoint})
    publish_and_wait(server, a, SYSTEM)
    a.events.removed(block_keys(SYSTEM)[-2:])
    router = server.proxy.routing
    wait_until(lambda: router.index.instances[a.url].blocks == SYSTEM_BLOCKS - 2)
    body = {**completion(SYSTEM + "Q"), "stream": True}
    assert post(server.url, "/v1/completions", body)[0] == 200
    assert metric(server.url, "kvtier_proxy_actual_cached_tokens_total") == 0, "no usage chunk"
    post(server.url, "/v1/completions", completion(SYSTEM + "Q"))
    assert metric(server.url, "kvtier_proxy_actual_cached_tokens_total") == 32
    health = get_json(server.url, "/health")
    assert health["policy"] == "cache_aware"
    rows = {r["url"]: r["kv_events"] for r in health["decode"]}
    assert rows[b.url] == {
        "endpoint": None,
        "state": "off",
        "last_seq": None,
        "last_event_age_s": None,
        "blocks": 0,
    }
    stream = rows[a.url]
    assert stream["endpoint"] == a.events.endpoint and stream["state"] == "connected"
    assert stream["last_seq"] == a.events.seq - 1 and stream["blocks"] == SYSTEM_BLOCKS - 2
    assert 0 <= stream["last_event_age_s"] < 10
    assert metric(server.url, "kvtier_proxy_index_blocks") == SYSTEM_BLOCKS - 2
    received = metric(server.url, "kvtier_proxy_kv_events_received_total", instance=a.url)
    assert received >= 2
    assert metric(server.url, "kvtier_proxy_kv_events_gaps_total", instance=a.url) == 0
    a.events.skip(3)
    a.events.stored([999], block_size=BLOCK)
    wait_until(lambda: metric(server.url, "kvtier_proxy_kv_events_gaps_total", instance=a.url) == 1)
    assert router.index.instances[a.url].blocks == 1, "a gap without replay drops the entries"


def test_command_flags_for_cache_aware(capsys):
    decode = "http://127.0.0.1:1"
    assert main(["proxy", "--decode", decode, "--policy", "cache_aware"]) == 2
    assert "--kv-events INSTANCE_URL=tcp://host:port" in capsys.readouterr().err
    events = f"--kv-events=http://127.0.0.1:2=tcp://127.0.0.1:{free_port()}"
    assert main(["proxy", "--decode", decode, "--policy", "cache_aware", events]) == 2
    err = capsys.readouterr().err
    assert "--kv-events http://127.0.0.1:2" in err and "no --prefill or --decode" in err
    assert main(["proxy", "--decode", decode, "--kv-events", f"{decode}=tcp://h:1"]) == 2
    assert "need --policy cache_aware" in capsys.readouterr().err
    bad = ["--policy", "cache_aware", "--kv-events", f"{decode}=tcp://h:1", "--weight-cpu", "-1"]
    assert main(["proxy", "--decode", decode, *bad]) == 2
    assert "--weight-cpu must be >= 0" in capsys.readouterr().err


def test_kv_events_and_remote_groups_name_an_instance_in_any_spelling(engines, proxy):
    """``--kv-events`` and ``--remote-group`` find their instance as ``--decode`` spells it
    however their URL is written: scheme and host case, a trailing slash, the default
    port, another name of this machine."""
    a, b = engines("a"), engines("b")
    port_a, port_b = (int(e.url.rsplit(":", 1)[1]) for e in (a, b))
    server = proxy(
        [a, b],
        kv_events={
            f"HTTP://LOCALHOST:{port_a}/": a.events.endpoint,
            f"http://[::1]:{port_b}": b.events.endpoint,
        },
        remote_groups={f"Http://127.0.0.1:{port_a}/": "shared"},
    )
    router = server.proxy.routing
    assert set(router.subscribers) == {a.url, b.url}
    assert router.index.instances[a.url].remote_group == "shared"
    publish_and_wait(server, b, SYSTEM + "Q1")
    assert post(server.url, "/v1/completions", completion(SYSTEM + "Q1"))[0] == 200
    assert len(b.completions()) == 1 and not a.completions()


def test_one_instance_given_twice_in_two_spellings_is_refused(engines):
    a = engines("a")
    port = int(a.url.rsplit(":", 1)[1])
    twice = {a.url: a.events.endpoint, f"http://localhost:{port}/": a.events.endpoint}
    settings = ProxySettings(
        prefill=(), decode=(a.url,), policy="cache_aware", routing=RoutingSettings(kv_events=twice)
    )
    with pytest.raises(ValueError, match=rf"--kv-events: instance {a.url} given twice"):
        Proxy(settings)


def test_hash_algo_auto_learns_the_engines_algorithm(engines, proxy):
    """The default ``--hash-algo auto`` starts with vLLM's own default (sha256) and
    switches to the algorithm the engines use once an event announces a prompt's first
    block with its tokens; routing then follows the cache."""
    a, b = engines("a"), engines("b")
    server = proxy([a, b], hash_algo="auto")
    router = server.proxy.routing
    assert router.hasher.algo == "sha256"
    tokens = fake_tokens({"prompt": SYSTEM + "Q1"})
    first = block_keys(SYSTEM + "Q1")[:1]
    for _ in range(50):  # the first announcements after a subscription may be lost
        b.events.stored(first, block_size=BLOCK, tokens=tokens[:BLOCK])
        with contextlib.suppress(AssertionError):
            wait_until(lambda: router.hasher.algo == "sha256_cbor", timeout=0.1)
            break
    assert router.hasher.algo == "sha256_cbor"
    publish_and_wait(server, b, SYSTEM + "Q1")
    assert post(server.url, "/v1/completions", completion(SYSTEM + "Q2"))[0] == 200
    assert len(b.completions()) == 1 and not a.completions()
