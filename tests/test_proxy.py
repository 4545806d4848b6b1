"""``kvtier proxy``: the prefill leg (one token, no stream), the decode leg (the client's
body byte for byte, its answer passed back: JSON, SSE chunks in order, errors), the
request id on both legs, instances marked down, skipped and re-tried, the two policies,
/health, /metrics, /v1/models, the API key, and the real command in a process of its own.

The engines are ``support.openai_fakes.FakeOpenAI`` apps; the proxy runs in a thread
(``AppThread``) except in the command-line test.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")

from support.openai_fakes import AppThread, Behaviour, FakeOpenAI

from kvtier.cli import main
from kvtier.proxy.app import Proxy, ProxySettings
from kvtier.proxy.instances import Pool

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
COMPLETION = {"model": "m", "prompt": "hello there", "max_tokens": 50, "min_tokens": 5}
GONE = {"endpoint": "/v1/completions", "status": "499"}  # the client went away
OK = {"endpoint": "/v1/completions", "status": "200"}
CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_completion_tokens": 20,
    "stream": True,
    "stream_options": {"include_usage": True},
}


# -- helpers -----------------------------------------------------------------------


def request(
    url: str, method: str, path: str, body: bytes | dict | None = None, headers=None
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request; (status, headers, body)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def post(url: str, path: str, body, headers=None):
    return request(url, "POST", path, body, {"Content-Type": "application/json", **(headers or {})})


def get_json(url: str, path: str) -> dict:
    return json.loads(request(url, "GET", path)[2])


def metric(url: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample of the proxy at ``url`` (0 when absent)."""
    text = request(url, "GET", "/metrics")[2].decode()
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = re.escape(f"{name}{{{wanted}}}" if labels else name) + r" (\S+)"
    found = re.search(f"^{pattern}$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


@pytest.fixture
def engines() -> Iterator[Callable[..., FakeOpenAI]]:
    """``engines(name, **behaviour)`` starts a fake engine; all stop after the test."""
    started: list[FakeOpenAI] = []

    def make(name: str, **behaviour) -> FakeOpenAI:
        fake = FakeOpenAI(name, Behaviour(**behaviour)).start()
        started.append(fake)
        return fake

    yield make
    for fake in started:
        fake.close()


@pytest.fixture
def proxy() -> Iterator[Callable[..., AppThread]]:
    """``proxy(prefill=[...], decode=[...], **settings)`` runs a proxy in a thread."""
    running: list[AppThread] = []

    def make(prefill: list[FakeOpenAI | str], decode: list[FakeOpenAI | str], **settings):
        urls = [[e if isinstance(e, str) else e.url for e in side] for side in (prefill, decode)]
        instance = Proxy(ProxySettings(prefill=tuple(urls[0]), decode=tuple(urls[1]), **settings))
        thread = AppThread(instance.build_app()).start()
        thread.proxy = instance
        running.append(thread)
        return thread

    yield make
    for thread in running:
        thread.close()


def dead_url() -> str:
    """A loopback URL where nothing listens."""
    fake = FakeOpenAI("dead").start()
    url = fake.url
    fake.close()
    return url


# -- the two legs ------------------------------------------------------------------


def test_prefill_gets_one_token_and_decode_gets_the_clients_body(engines, proxy):
    prefill, decode = engines("prefill"), engines("decode")
    server = proxy([prefill], [decode])
    raw = json.dumps(COMPLETION, indent=1).encode()  # odd formatting must reach decode as is
    status, headers, body = post(server.url, "/v1/completions", raw, {"X-Request-Id": "req-7"})
    assert status == 200
    assert json.loads(body) == decode.answer("req-7")
    assert headers["X-Request-Id"] == "req-7"
    [prefill_leg], [decode_leg] = prefill.received, decode.received
    expected = {k: v for k, v in COMPLETION.items() if k != "min_tokens"}
    assert prefill_leg.body == {**expected, "max_tokens": 1, "stream": False}
    assert decode_leg.raw == raw
    assert prefill_leg.headers["X-Request-Id"] == decode_leg.headers["X-Request-Id"] == "req-7"


def test_chat_stream_passes_sse_chunks_through_in_order(engines, proxy):
    prefill, decode = engines("prefill"), engines("decode", chunks=4, chunk_delay_s=0.15)
    server = proxy([prefill], [decode])
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    started = time.monotonic()
    conn.request("POST", "/v1/chat/completions", json.dumps(CHAT).encode())
    response = conn.getresponse()
    first_line = response.readline()
    first_at = time.monotonic() - started
    rest = response.read()
    total = time.monotonic() - started
    conn.close()
    assert response.status == 200
    assert response.getheader("Content-Type").startswith("text/event-stream")
    request_id = response.getheader("X-Request-Id")
    assert request_id, "the proxy generates a request id when the client sends none"
    assert first_line + rest == b"".join(decode.events(request_id))
    assert first_at < 0.3 < total, "chunks are passed on as they come, not at the end"
    [prefill_leg], [decode_leg] = prefill.received, decode.received
    assert prefill_leg.path == decode_leg.path == "/v1/chat/completions"
    assert prefill_leg.body["max_tokens"] == prefill_leg.body["max_completion_tokens"] == 1
    assert prefill_leg.body["stream"] is False and "stream_options" not in prefill_leg.body
    assert prefill_leg.body["messages"] == CHAT["messages"]
    assert decode_leg.body == CHAT
    assert prefill_leg.headers["X-Request-Id"] == decode_leg.headers["X-Request-Id"] == request_id


@pytest.mark.parametrize("status", [400, 404, 500])
def test_decode_errors_pass_through_unchanged(engines, proxy, status):
    prefill, decode = engines("prefill"), engines("decode", status=status)
    server = proxy([prefill], [decode])
    got, _, body = post(server.url, "/v1/completions", COMPLETION)
    assert got == status
    assert json.loads(body)["error"]["message"] == "decode says no"
    health = get_json(server.url, "/health")
    assert health["decode"][0]["up"] is (status < 500), "a 5xx marks the instance down"


def test_prefill_rejection_still_goes_to_decode(engines, proxy):
    prefill, decode = engines("prefill", status=400), engines("decode")
    server = proxy([prefill], [decode])
    status, _, body = post(server.url, "/v1/completions", COMPLETION)
    assert status == 200 and json.loads(body)["model"] == "decode"
    assert metric(server.url, "kvtier_proxy_prefill_skipped_total", reason="prefill_rejected") == 1
    assert get_json(server.url, "/health")["prefill"][0]["up"], "a 4xx is not a failure"


def test_body_that_is_not_json_is_refused(engines, proxy):
    decode = engines("decode")
    server = proxy([], [decode])
    status, _, body = post(server.url, "/v1/completions", b"[1, 2")
    assert status == 400 and "JSON object" in json.loads(body)["error"]["message"]
    assert decode.received == []


def test_stream_cut_by_decode_is_cut_for_the_client(engines, proxy):
    decode = engines("decode", chunks=4, cut_after=2)
    server = proxy([], [decode], retry_after_s=60)
    with pytest.raises(http.client.IncompleteRead) as cut:
        post(server.url, "/v1/completions", {**COMPLETION, "stream": True})
    assert cut.value.partial.startswith(b"data: ")
    assert get_json(server.url, "/health")["decode"][0]["up"] is False
    requests = "kvtier_proxy_requests_total"
    wait_until(lambda: metric(server.url, requests, endpoint="/v1/completions", status="504") == 1)
    assert metric(server.url, requests, endpoint="/v1/completions", status="200") == 0


def test_client_leaving_mid_stream_abandons_the_decode_stream(engines, proxy):
    decode = engines("decode", chunks=50, chunk_delay_s=0.05)
    server = proxy([], [decode])
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", "/v1/completions", json.dumps({**COMPLETION, "stream": True}))
    assert conn.getresponse().readline().startswith(b"data: ")
    conn.close()
    wait_until(lambda: decode.abandoned_streams == 1)
    wait_until(lambda: server.proxy.decode.instances[0].in_flight == 0)
    assert server.proxy.decode.instances[0].failures == 0, "a client leaving is no failure"
    assert post(server.url, "/v1/completions", COMPLETION)[0] == 200


def test_client_leaving_right_after_done_is_logged_as_one_request(engines, proxy, caplog):
    # the fake waits chunk_delay_s after [DONE] before ending its answer: the client is
    # gone by the time the proxy ends its own
    decode = engines("decode", chunks=2, chunk_delay_s=0.3)
    server = proxy([], [decode])
    caplog.set_level(logging.INFO)
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    body = json.dumps({**COMPLETION, "stream": True})
    conn.request("POST", "/v1/completions", body, {"X-Request-Id": "done-1"})
    response = conn.getresponse()
    while response.readline() != b"data: [DONE]\n":
        pass
    conn.close()
    wait_until(lambda: server.proxy.decode.instances[0].in_flight == 0)
    wait_until(lambda: any(r.getMessage().startswith("done-1 ") for r in caplog.records))
    assert [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR] == []
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("done-1 /v1")]
    assert "decode=" in line and " 200 " in line


def test_client_leaving_before_the_answer_closes_the_legs_in_flight(engines):
    """Served as ``kvtier proxy`` serves (a handler is cancelled when its client goes),
    a client that leaves while a leg waits for its answer closes that leg's request, so
    the engine aborts it, and the decode leg is not sent."""
    prefill, decode = engines("prefill", delay_s=0.6), engines("decode", delay_s=0.6)
    settings = ProxySettings(prefill=(prefill.url,), decode=(decode.url,))
    proxy = Proxy(settings)
    server = AppThread(proxy.build_app(), handler_cancellation=True).start()
    try:
        for leg in (prefill, decode):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            conn.request("POST", "/v1/completions", json.dumps(COMPLETION))
            wait_until(lambda leg=leg: leg.in_flight == 1)
            conn.close()
            wait_until(lambda leg=leg: leg.abandoned_answers == 1)
            if leg is prefill:
                assert decode.received == [], "no decode leg for a client gone"
                prefill.behaviour.delay_s = 0.0
        wait_until(lambda: proxy.decode.instances[0].in_flight == 0)
        assert proxy.prefill.instances[0].failures == proxy.decode.instances[0].failures == 0
        assert metric(server.url, "kvtier_proxy_requests_total", **GONE) == 2
    finally:
        server.close()


def test_client_leaving_before_the_streams_headers_is_no_server_error(engines, proxy, caplog):
    decode = engines("decode", delay_s=0.5, chunks=50, chunk_delay_s=0.05)
    server = proxy([], [decode])
    caplog.set_level(logging.INFO)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("POST", "/v1/completions", json.dumps({**COMPLETION, "stream": True}))
    wait_until(lambda: decode.in_flight == 1)
    conn.close()
    wait_until(lambda: decode.abandoned_streams == 1)
    wait_until(lambda: server.proxy.decode.instances[0].in_flight == 0)
    assert [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR] == []
    assert metric(server.url, "kvtier_proxy_requests_total", **OK) == 1


# -- failures ------------------------------------------------------------------------


def test_down_prefill_is_skipped_then_retried_after_the_delay(engines, proxy):
    a, b, decode = engines("a"), engines("b"), engines("decode")
    a.stop()
    server = proxy([a, b], [decode], retry_after_s=0.5)
    for _ in range(4):
        assert post(server.url, "/v1/completions", COMPLETION)[0] == 200
    assert len(b.received) == 4 and len(decode.received) == 4
    [a_row, b_row] = get_json(server.url, "/health")["prefill"]
    assert a_row["up"] is False and a_row["failures"] == 1, "tried once, then skipped"
    assert "retry_in_s" in a_row and b_row["up"] is True
    assert metric(server.url, "kvtier_proxy_instance_up", role="prefill", instance=a.url) == 0
    a.start()  # back on the same port: the health probe finds it after the delay
    wait_until(lambda: get_json(server.url, "/health")["prefill"][0]["up"])
    assert a.health_checks >= 1
    for _ in range(4):
        assert post(server.url, "/v1/completions", COMPLETION)[0] == 200
    assert len(a.received) == 2 and len(b.received) == 6, "round robin over both again"


def test_instance_is_retried_by_the_next_request_once_its_delay_is_over(engines, proxy):
    decode_a, decode_b = engines("a", status=500, health_status=503), engines("b")
    server = proxy([], [decode_a, decode_b], retry_after_s=0)  # the probe keeps it down
    assert post(server.url, "/v1/completions", COMPLETION)[0] == 500
    assert get_json(server.url, "/health")["decode"][0]["up"] is False
    decode_a.behaviour.status = 200
    models = [json.loads(post(server.url, "/v1/completions", COMPLETION)[2])["model"]]
    models.append(json.loads(post(server.url, "/v1/completions", COMPLETION)[2])["model"])
    assert models == ["b", "a"], "the next pick of a re-tries it"
    assert get_json(server.url, "/health")["decode"][0]["up"] is True


def test_every_prefill_down_sends_to_decode_alone(engines, proxy):
    decode = engines("decode")
    server = proxy([dead_url()], [decode], retry_after_s=60)
    for _ in range(3):
        status, _, body = post(server.url, "/v1/completions", COMPLETION)
        assert status == 200 and json.loads(body)["model"] == "decode"
    assert [r.body for r in decode.received] == [COMPLETION] * 3
    skipped = "kvtier_proxy_prefill_skipped_total"
    assert metric(server.url, skipped, reason="prefill_failed") == 1
    assert metric(server.url, skipped, reason="no_prefill_instance") == 2
    health = get_json(server.url, "/health")
    assert health["status"] == "degraded" and health["prefill"][0]["up"] is False


def test_prefill_timeout_goes_to_decode_and_decode_timeout_answers_504(engines, proxy):
    prefill, decode = engines("prefill", delay_s=1.0), engines("decode")
    server = proxy([prefill], [decode], prefill_timeout_s=0.2, decode_timeout_s=0.2)
    status, _, body = post(server.url, "/v1/completions", COMPLETION)
    assert status == 200 and json.loads(body)["model"] == "decode"
    assert metric(server.url, "kvtier_proxy_prefill_skipped_total", reason="prefill_failed") == 1
    decode.behaviour.delay_s = 1.0
    assert post(server.url, "/v1/completions", COMPLETION)[0] == 504
    health = get_json(server.url, "/health")
    assert health["status"] == "down" and health["decode"][0]["last_error"] == "timed out"


def test_down_decode_is_skipped_and_none_up_answers_503(engines, proxy):
    live = engines("live")
    server = proxy([], [dead_url(), live], retry_after_s=60)
    for _ in range(3):
        status, _, body = post(server.url, "/v1/completions", COMPLETION)
        assert status == 200 and json.loads(body)["model"] == "live"
    live.stop()
    status, headers, body = post(server.url, "/v1/completions", COMPLETION)
    assert status == 503 and json.loads(body)["error"]["type"] == "ServiceUnavailableError"
    assert 59 <= int(headers["Retry-After"]) <= 60, "when an instance is tried again"
    status, headers, _ = request(server.url, "GET", "/v1/models")
    assert status == 503 and 1 <= int(headers["Retry-After"]) <= 60
    assert request(server.url, "GET", "/health")[0] == 503


def test_no_decode_instance_up_answers_503_without_a_prefill_leg(engines, proxy):
    prefill, decode = engines("prefill"), engines("decode")
    server = proxy([prefill], [decode], retry_after_s=60)
    decode.stop()
    assert post(server.url, "/v1/completions", COMPLETION)[0] == 503, "the decode leg failed"
    sent = len(prefill.received)
    status, headers, _ = post(server.url, "/v1/completions", COMPLETION)
    assert status == 503 and 59 <= int(headers["Retry-After"]) <= 60
    assert len(prefill.received) == sent, "a prefill whose KV no decode instance would load"


def test_models_5xx_marks_the_instance_down_until_its_health_probe_passes(engines, proxy):
    failing = engines("failing", models_status=500, health_status=503)
    live = engines("live")
    server = proxy([], [failing, live], retry_after_s=0.2)
    status, _, body = request(server.url, "GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "live", "the next one asked"
    failing_row = get_json(server.url, "/health")["decode"][0]
    assert failing_row["up"] is False and failing_row["last_error"] == "HTTP 500"
    wait_until(lambda: failing.health_checks >= 2)
    assert get_json(server.url, "/health")["decode"][0]["up"] is False, "/health answers 503"
    failing.behaviour.health_status = 200
    wait_until(lambda: get_json(server.url, "/health")["decode"][0]["up"])
    live.behaviour.models_status = 500
    status, _, body = request(server.url, "GET", "/v1/models")
    assert status == 500 and json.loads(body)["error"]["message"].endswith("has no models")
    assert get_json(server.url, "/health")["status"] == "down", "the last 5xx, as it came"


def test_an_instance_in_both_roles_is_refused_naming_the_flags(engines, capsys):
    engine = engines("both")
    for decode in (engine.url, engine.url.removeprefix("http://") + "/"):
        with pytest.raises(ValueError, match="both as --prefill and as --decode"):
            Proxy(ProxySettings(prefill=(engine.url,), decode=("http://127.0.0.1:1", decode)))
    assert main(["proxy", "--prefill", engine.url, "--decode", engine.url]) == 2
    err = capsys.readouterr().err
    assert f"{engine.url} given both as --prefill and as --decode" in err, err
    assert engine.received == [] and engine.health_checks == 0


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [
        ("http://localhost:8100", "http://127.0.0.1:8100"),
        ("http://[::1]:8100", "localhost:8100"),
        ("http://0.0.0.0:8100", "http://[0:0::1]:8100"),
        ("http://10.0.0.1", "http://10.0.0.1:80"),
        ("https://gpu1", "https://GPU1:443"),
        ("http://[::ffff:10.0.0.1]:8100", "http://10.0.0.1:8100"),
    ],
)
def test_one_instance_under_two_spellings_is_refused_in_both_roles(prefill, decode):
    with pytest.raises(ValueError, match=r"\(= .*\) given both as --prefill and as --decode"):
        Proxy(ProxySettings(prefill=(prefill,), decode=(decode,)))
    with pytest.raises(ValueError, match="decode instances given twice"):
        Pool("decode", [prefill, decode])


def test_distinct_hosts_and_ports_are_distinct_instances():
    """Names are not resolved: a name and an address are two hosts (docs/proxy.md)."""
    for prefill, decode in (
        ("http://localhost:8100", "http://localhost:8200"),
        ("http://127.0.0.2:8100", "http://127.0.0.1:8100"),
        ("http://10.0.0.1:8100", "https://10.0.0.1:8100"),
        ("http://gpu1:8100", "http://10.0.0.1:8100"),
    ):
        Proxy(ProxySettings(prefill=(prefill,), decode=(decode,)))


# -- policies --------------------------------------------------------------------------


def test_round_robin_and_least_loaded_pick_over_a_fake_clock():
    now = [0.0]
    pool = Pool("decode", ["h:1", "h:2", "h:3"], "round_robin", 5.0, clock=lambda: now[0])
    assert [pool.pick().url[-1] for _ in range(4)] == ["1", "2", "3", "1"]
    pool.mark_down(pool.instances[1], "refused")
    assert [pool.pick().url[-1] for _ in range(4)] == ["3", "1", "3", "1"]
    now[0] = 5.0
    assert [pool.pick().url[-1] for _ in range(3)] == ["2", "3", "1"], "eligible after 5 s"
    loaded = Pool("decode", ["h:1", "h:2"], "least_loaded", clock=lambda: now[0])
    with loaded.in_flight(loaded.pick()) as first:
        assert first.url.endswith("1") and loaded.pick().url.endswith("2")
        assert loaded.pick().url.endswith("2")
    assert [loaded.pick().url[-1] for _ in range(2)] == ["1", "2"], "ties: least recent"
    with pytest.raises(ValueError, match="round_robin, least_loaded"):
        Pool("decode", ["h:1"], "random")


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded"])
def test_policy_with_one_busy_decode_instance(engines, proxy, policy):
    slow, fast = engines("slow", delay_s=0.3), engines("fast")
    server = proxy([], [slow, fast], policy=policy)
    busy = threading.Thread(target=post, args=(server.url, "/v1/completions", COMPLETION))
    busy.start()
    wait_until(lambda: slow.in_flight == 1)
    for _ in range(4):
        post(server.url, "/v1/completions", COMPLETION)
    busy.join()
    # round robin takes turns whatever the load; least loaded avoids the busy one
    assert len(fast.received) == (2 if policy == "round_robin" else 4)


# -- the other endpoints -----------------------------------------------------------


def test_models_health_and_metrics(engines, proxy):
    prefill, decode = engines("prefill"), engines("decode")
    server = proxy([prefill], [decode])
    status, headers, body = request(server.url, "GET", "/v1/models", headers={"X-Request-Id": "m1"})
    assert status == 200 and json.loads(body)["data"][0]["id"] == "decode"
    assert headers["X-Request-Id"] == "m1"
    health = get_json(server.url, "/health")
    assert health["status"] == "ok" and health["policy"] == "round_robin"
    assert health["prefill"] == [
        {"url": prefill.url, "up": True, "in_flight": 0, "requests": 0, "failures": 0}
    ]
    post(server.url, "/v1/completions", COMPLETION)
    post(server.url, "/v1/chat/completions", CHAT)
    requests = "kvtier_proxy_requests_total"
    assert metric(server.url, requests, endpoint="/v1/completions", status="200") == 1
    assert metric(server.url, requests, endpoint="/v1/chat/completions", status="200") == 1
    assert metric(server.url, requests, endpoint="/v1/models", status="200") == 1
    for role, fake, sent in (("prefill", prefill, 2), ("decode", decode, 3)):  # + /v1/models
        labels = {"role": role, "instance": fake.url}
        assert metric(server.url, "kvtier_proxy_instance_up", **labels) == 1
        assert metric(server.url, "kvtier_proxy_instance_in_flight", **labels) == 0
        assert metric(server.url, "kvtier_proxy_instance_requests_total", **labels) == sent
        assert metric(server.url, "kvtier_proxy_instance_failures_total", **labels) == 0
    for histogram in ("prefill", "decode", "decode_first_byte", "overhead"):
        assert metric(server.url, f"kvtier_proxy_{histogram}_seconds_count") == 2
    overhead = metric(server.url, "kvtier_proxy_overhead_seconds_sum") / 2
    assert 0 < overhead < 0.05


def test_metrics_are_the_documented_series_and_no_others(engines, proxy):
    """docs/proxy.md's table, each family once, with no ``*_created`` series beside."""
    from prometheus_client.parser import text_string_to_metric_families

    server = proxy([engines("prefill")], [engines("decode")])
    post(server.url, "/v1/completions", COMPLETION)
    text = request(server.url, "GET", "/metrics")[2].decode()
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    legs = ("prefill", "decode_first_byte", "decode", "overhead")
    assert families == {
        "kvtier_proxy_requests": "counter",
        "kvtier_proxy_prefill_skipped": "counter",
        "kvtier_proxy_instance_up": "gauge",
        "kvtier_proxy_instance_in_flight": "gauge",
        "kvtier_proxy_instance_requests": "counter",
        "kvtier_proxy_instance_failures": "counter",
        **{f"kvtier_proxy_{leg}_seconds": "histogram" for leg in legs},
    }
    assert "_created" not in text


def test_models_is_counted_and_a_slow_instance_is_left_after_its_timeout(engines, proxy):
    slow, live = engines("slow", models_delay_s=2.0), engines("live")
    server = proxy([], [slow, live], models_timeout_s=0.3, retry_after_s=60)
    started = time.monotonic()
    status, _, body = request(server.url, "GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "live", "the next one asked"
    assert time.monotonic() - started < 1.5, "not the prefill leg's 300 s"
    assert get_json(server.url, "/health")["decode"][0]["up"] is False
    requests = "kvtier_proxy_requests_total"
    assert metric(server.url, requests, endpoint="/v1/models", status="200") == 1
    for fake, failures in ((slow, 1), (live, 0)):
        labels = {"role": "decode", "instance": fake.url}
        assert metric(server.url, "kvtier_proxy_instance_requests_total", **labels) == 1
        assert metric(server.url, "kvtier_proxy_instance_failures_total", **labels) == failures


def test_api_key_is_required_and_passed_on(engines, proxy):
    prefill, decode = engines("prefill"), engines("decode")
    server = proxy([prefill], [decode], api_key="sk-1")
    assert post(server.url, "/v1/completions", COMPLETION)[0] == 401
    wrong = {"Authorization": "Bearer sk-2"}
    assert post(server.url, "/v1/completions", COMPLETION, wrong)[0] == 401
    assert request(server.url, "GET", "/v1/models")[0] == 401
    right = {"Authorization": "Bearer sk-1"}
    assert post(server.url, "/v1/completions", COMPLETION, right)[0] == 200
    assert prefill.received[0].headers["Authorization"] == "Bearer sk-1"
    assert decode.received[0].headers["Authorization"] == "Bearer sk-1"
    assert request(server.url, "GET", "/health")[0] == 200, "health needs no key"
    assert (
        metric(server.url, "kvtier_proxy_requests_total", endpoint="/v1/completions", status="401")
        == 2
    )


# -- the command -------------------------------------------------------------------


def test_kvtier_proxy_command_serves_until_sigterm(engines):
    prefill, decode = engines("prefill"), engines("decode")
    command = [sys.executable, "-m", "kvtier", "proxy", "--port", "0"]
    command += ["--prefill", prefill.url, "--decode", decode.url, "--policy", "least_loaded"]
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not (found := re.search(r"listening on (http://\S+)", "".join(lines))):
            line = process.stderr.readline()
            assert line, f"kvtier proxy exited: {''.join(lines)}"
            lines.append(line)
        url = found.group(1)
        headers = {"X-Request-Id": "cli-1"}
        status, _, body = post(url, "/v1/completions", {**COMPLETION, "stream": True}, headers)
        assert status == 200 and body == b"".join(decode.events("cli-1"))
        assert prefill.received[0].body["max_tokens"] == 1
        decode.behaviour.delay_s = 0.5  # a client leaving closes the decode leg's request
        port = int(url.rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", "/v1/completions", json.dumps(COMPLETION))
        wait_until(lambda: decode.in_flight == 1)
        conn.close()
        wait_until(lambda: decode.abandoned_answers == 1)
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0
        log = "".join(lines) + process.stderr.read()
        assert "cli-1 /v1/completions prefill=" in log, "one line per request, with its id"
    finally:
        process.kill()
        process.wait()


def test_command_refuses_bad_flags_and_names_the_extra_without_aiohttp(capsys, monkeypatch):
    assert main(["proxy", "--prefill", "http://127.0.0.1:1"]) == 2
    assert "--decode" in capsys.readouterr().err
    assert main(["proxy", "--decode", "ftp://x:1"]) == 2
    assert "http or https" in capsys.readouterr().err
    for url in ("http://x:1/v1", "http://x:1?k=1", "x:1/#f"):  # /v1/v1/completions: 404s
        assert main(["proxy", "--decode", url]) == 2
        assert "the server's address alone" in capsys.readouterr().err
    assert main(["proxy", "--decode", "http://user:secret@x:1"]) == 2
    err = capsys.readouterr().err
    assert "user or password" in err, err
    assert main(["proxy", "--decode", "http://a b:1"]) == 2
    assert "space" in capsys.readouterr().err
    assert main(["proxy", "--decode", "http://x:0"]) == 2
    err = capsys.readouterr().err
    assert "--decode 'http://x:0'" in err and "port 0" in err, err
    assert main(["proxy", "--decode", "http://x:1", "--prefill", "x:0"]) == 2
    assert "--prefill 'x:0'" in capsys.readouterr().err
    for flag in ("--api-key", "--hash-seed"):
        assert main(["proxy", "--decode", "http://x:1", flag, ""]) == 2
        err = capsys.readouterr().err
        assert f"{flag} is empty" in err, err
    monkeypatch.setitem(sys.modules, "aiohttp", None)
    assert main(["proxy", "--decode", "http://127.0.0.1:1"]) == 2
    assert "pip install 'kvtier[proxy]'" in capsys.readouterr().err


def test_an_upper_case_scheme_is_the_same_instance():
    from kvtier.proxy.instances import normalize_url

    assert normalize_url("HTTP://Host:8000/") == "http://Host:8000"
    assert normalize_url("HTTPS://h:1") == "https://h:1"
