"""``kvtier serve``'s router-facing API against a live server: ``POST /lookup`` (tokens or
chunk hashes in, cached prefix tokens out), ``POST /clear`` of one model, and ``kvtier
status --server``."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import urllib.request

import pytest
from support.kvtier_server import KVTierServerProcess, free_port

from kvtier import web
from kvtier.chunker import Chunker, MultiModalSpan, RequestExtras
from kvtier.cli import main
from kvtier.commands.status import render
from kvtier.hashing import ChunkHasher
from kvtier.keys import CacheKey
from kvtier.server import lookup as lookup_module
from kvtier.server.admin import MAX_BODY_BYTES, AdminHooks, AdminServer
from kvtier.server.lookup import KeyShapes

MODEL = "org/Llama-3 8B"  # a name that needs percent-encoding
CHUNK = 16


def chunk_hashes(tokens, *, chunk_size=CHUNK, algorithm="sha256_cbor", salt=None, seed=None, mm=()):
    hasher = ChunkHasher(algorithm) if seed is None else ChunkHasher(algorithm, seed)
    db = Chunker(chunk_size, hasher, CacheKey("x", 1, 0, "x", b""))
    return db.chunk_hashes(tokens, RequestExtras(cache_salt=salt, mm=mm), include_partial=True)


def names(hashes, *, world=1, rank=0, layers=None, dtype="bfloat16", model=MODEL, tags=()):
    """The blob names an engine of this shape stores for ``hashes``."""
    out = []
    for h in hashes:
        key = CacheKey(model, world, rank, dtype, h, None, tags)
        if layers is None:
            out.append(key.to_string())
        else:
            out.extend(key.with_layer(layer).to_string() for layer in range(layers))
    return out


def put(server, blob_names, model=MODEL):
    from kvtier.storage.remote import space_of

    client = server.client(space_of(model))
    client.put_many([(n, [b"blob:" + n.encode()]) for n in blob_names])
    client.close()


def lookup(server, body, headers=None):
    return server.admin("/lookup", "POST", body=body, headers=headers)


TOKENS = list(range(100, 100 + 5 * CHUNK + 7))  # 5 full chunks and a partial one


@pytest.fixture
def server(tmp_path):
    with KVTierServerProcess(
        "--chunk-size", str(CHUNK), "--local-disk", str(tmp_path / "disk"), admin=True
    ) as server:
        yield server


def test_lookup_by_tokens_counts_the_held_prefix(server):
    hashes = chunk_hashes(TOKENS)
    assert lookup(server, {"model": MODEL, "tokens": TOKENS}) == (
        200,
        {"cached_tokens": 0, "cached_chunks": 0, "total_chunks": 6, "chunk_size": CHUNK},
    )
    put(server, names(hashes[:2] + hashes[3:4]))  # chunk 2 is missing
    status, body = lookup(server, {"model": MODEL, "tokens": TOKENS})
    assert status == 200 and (body["cached_tokens"], body["cached_chunks"]) == (2 * CHUNK, 2)
    put(server, names(hashes[2:]))  # the rest, the partial last chunk included
    assert lookup(server, {"model": MODEL, "tokens": TOKENS})[1]["cached_tokens"] == len(TOKENS)
    # another prompt sharing three chunks, then diverging
    other = TOKENS[: 3 * CHUNK] + [7] * (2 * CHUNK)
    assert lookup(server, {"model": MODEL, "tokens": other})[1]["cached_tokens"] == 3 * CHUNK
    # another model holds nothing of it
    assert lookup(server, {"model": "org/other", "tokens": TOKENS})[1]["cached_tokens"] == 0


def test_lookup_by_hashes_and_with_the_engines_hash_settings(server):
    hashes = chunk_hashes(TOKENS[: 4 * CHUNK], chunk_size=2 * CHUNK, algorithm="xxh3_128")
    put(server, names(hashes))
    hexes = [h.hex() for h in hashes]
    body = {"model": MODEL, "hashes": hexes, "chunk_size": 2 * CHUNK}
    assert lookup(server, body)[1]["cached_tokens"] == 4 * CHUNK
    body = {"model": MODEL, "hashes": [*hexes[:1], "ab" * 16], "chunk_size": 2 * CHUNK}
    assert lookup(server, body)[1]["cached_tokens"] == 2 * CHUNK
    by_tokens = {"model": MODEL, "tokens": TOKENS[: 4 * CHUNK], "chunk_size": 2 * CHUNK}
    assert lookup(server, by_tokens)[1]["cached_tokens"] == 0  # the server hashes sha256_cbor
    by_tokens["hash_algorithm"] = "xxh3_128"
    assert lookup(server, by_tokens)[1]["cached_tokens"] == 4 * CHUNK


def test_a_cache_salt_separates_prompts(server):
    salted = chunk_hashes(TOKENS, salt="tenant-a")
    put(server, names(salted))
    body = {"model": MODEL, "tokens": TOKENS}
    assert lookup(server, body)[1]["cached_tokens"] == 0
    assert lookup(server, {**body, "cache_salt": "tenant-b"})[1]["cached_tokens"] == 0
    assert lookup(server, {**body, "cache_salt": "tenant-a"})[1]["cached_tokens"] == len(TOKENS)


def test_a_multimodal_prompt_is_looked_up_with_its_items(server):
    """The engine keys a chunk with the multimodal items whose placeholders it covers: a
    lookup gives them (``mm_items``) or counts chunks the engine would not load."""
    image = MultiModalSpan("image-digest-a", 2 * CHUNK + 3, 20)  # chunks 2 and 3
    item = {"identifier": image.identifier, "offset": image.offset, "length": image.length}
    body = {"model": MODEL, "tokens": TOKENS}
    put(server, names(chunk_hashes(TOKENS)))  # the same token ids with no image
    assert lookup(server, body)[1]["cached_tokens"] == len(TOKENS)
    assert lookup(server, {**body, "mm_items": [item]})[1]["cached_tokens"] == 2 * CHUNK
    put(server, names(chunk_hashes(TOKENS, mm=(image,))))
    assert lookup(server, {**body, "mm_items": [item]})[1]["cached_tokens"] == len(TOKENS)
    other = {**item, "identifier": "image-digest-b"}
    assert lookup(server, {**body, "mm_items": [other]})[1]["cached_tokens"] == 2 * CHUNK


def test_a_chunk_counts_only_when_every_rank_and_layer_holds_it(server):
    hashes = chunk_hashes(TOKENS)[:3]
    put(server, names(hashes, world=2, rank=0, layers=3))
    put(server, names(hashes[:2], world=2, rank=1, layers=3))
    body = {"model": MODEL, "tokens": TOKENS[: 3 * CHUNK]}
    assert lookup(server, body)[1]["cached_tokens"] == 2 * CHUNK
    put(server, names(hashes[2:], world=2, rank=1, layers=2))  # layer 2 of rank 1 missing
    assert lookup(server, body)[1]["cached_tokens"] == 2 * CHUNK
    put(server, names(hashes[2:], world=2, rank=1, layers=3))
    assert lookup(server, body)[1]["cached_tokens"] == 3 * CHUNK


def test_a_restarted_server_answers_lookups_for_its_disk(server):
    put(server, names(chunk_hashes(TOKENS)))
    server.kill()
    server.start()  # empty memory, same disk (its index and the learnt key shapes)
    assert lookup(server, {"model": MODEL, "tokens": TOKENS})[1]["cached_tokens"] == len(TOKENS)


def test_key_shapes_of_many_namespaces_stay_bounded_and_cheap_to_save(tmp_path, monkeypatch):
    """A client touching namespace after namespace: the shapes of those stored into
    longest ago are forgotten past ``MAX_SHAPES``, and the file is not rewritten whole
    for each new one (written at most every ``SAVE_INTERVAL_S``, and at close)."""
    monkeypatch.setattr(lookup_module, "MAX_SHAPES", 50)
    writes = []
    replace = os.replace
    monkeypatch.setattr(lookup_module.os, "replace", lambda *a: writes.append(replace(*a)))
    shapes = KeyShapes(tmp_path)
    key = CacheKey("m", 1, 0, "bfloat16", b"\x01")
    for i in range(200):
        shapes.learn(f"ns-{i}", CacheKey(f"m{i}", 1, 0, "bfloat16", b"\x01").to_string())
        shapes.learn("kept", key.to_string())  # stored into all along
    assert len(shapes.namespaces()) == 50
    assert {"kept", "ns-199"} <= set(shapes.namespaces()) and "ns-0" not in shapes.namespaces()
    assert len(writes) <= 3
    shapes.close()
    assert set(KeyShapes(tmp_path).namespaces()) == set(shapes.namespaces())


@pytest.mark.parametrize(
    "body, field",
    [
        ({"tokens": [1, 2]}, "'model'"),
        ({"model": MODEL}, "'tokens'"),
        ({"model": MODEL, "tokens": [1], "hashes": ["00"]}, "'tokens'"),
        ({"model": MODEL, "tokens": [1, -2]}, "'tokens'"),
        ({"model": MODEL, "tokens": "1 2 3"}, "'tokens'"),
        ({"model": MODEL, "hashes": ["zz"]}, "'hashes'"),
        ({"model": MODEL, "hashes": ["00"], "num_tokens": 99999}, "'num_tokens'"),
        ({"model": MODEL, "tokens": [1], "chunk_size": 0}, "'chunk_size'"),
        ({"model": MODEL, "tokens": [1], "hash_algorithm": "md5"}, "'hash_algorithm'"),
        ({"model": MODEL, "tokens": [1], "mm_items": ["img"]}, "'mm_items'"),
        (
            {"model": MODEL, "tokens": [1], "mm_items": [{"identifier": "i", "offset": 0}]},
            "'mm_items'",
        ),
        (
            {
                "model": MODEL,
                "tokens": [1, 2],
                "mm_items": [{"identifier": "i", "offset": 1, "length": 2}],
            },
            "'mm_items'",
        ),
        ({"model": MODEL, "tokens": [1], "prompt_embeds": "..."}, "'prompt_embeds'"),
        ([1, 2, 3], "JSON object"),
    ],
)
def test_bad_lookups_are_400_naming_the_field(server, body, field):
    status, reply = lookup(server, body)
    assert status == 400 and field in reply["error"], reply
    assert server.admin("/health")[0] == 200


def test_clear_of_one_model_keeps_the_others(server):
    put(server, names(chunk_hashes(TOKENS)))
    put(server, names(chunk_hashes(TOKENS), model="org/other"), model="org/other")
    status, reply = server.admin("/clear", "POST", body={"model": "org/other"})
    assert status == 200 and reply["deleted"] == 6
    assert lookup(server, {"model": MODEL, "tokens": TOKENS})[1]["cached_tokens"] == len(TOKENS)
    assert lookup(server, {"model": "org/other", "tokens": TOKENS})[1]["cached_tokens"] == 0
    assert server.admin("/clear", "POST", body={"model": 3})[0] == 400


def test_with_a_token_the_post_endpoints_need_it():
    with KVTierServerProcess("--auth-token", "s3cret", admin=True, token="s3cret") as server:
        body = {"model": MODEL, "tokens": TOKENS}
        status, reply = lookup(server, body)
        assert status == 401 and "Bearer" in reply["error"]
        assert lookup(server, body, {"Authorization": "Bearer s3cret"})[0] == 200
        assert server.admin("/clear", "POST")[0] == 401
        assert server.admin("/health")[0] == 200  # GETs stay open


def raw_admin(server, method, path, headers=None):
    """``(status, headers, decoded JSON body)`` of a request sent as is (no body)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.admin_port, timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.headers, json.loads(response.read())
    finally:
        conn.close()


@pytest.mark.parametrize(
    "method, path, allowed",
    [("GET", "/clear", "POST"), ("GET", "/lookup", "POST"), ("POST", "/health", "GET")],
)
def test_a_method_an_endpoint_does_not_take_is_405_with_allow(server, method, path, allowed):
    status, headers, reply = raw_admin(server, method, path)
    assert status == 405 and allowed in headers["Allow"].split(","), headers
    assert allowed in reply["error"] and path in reply["error"]
    assert raw_admin(server, "GET", "/nope")[::2] == (404, {"error": "no such endpoint /nope"})


def test_a_body_over_the_limit_is_refused_unread(server):
    length = {"Content-Length": str(MAX_BODY_BYTES + 1)}  # announced, never sent
    status, _, reply = raw_admin(server, "POST", "/lookup", length)
    assert status == 400 and f"at most {MAX_BODY_BYTES} bytes" in reply["error"]
    assert lookup(server, {"model": MODEL, "tokens": TOKENS})[0] == 200


def test_a_body_nested_too_deep_to_parse_is_400(server):
    deep = b"[" * 100_000 + b"]" * 100_000
    conn = http.client.HTTPConnection("127.0.0.1", server.admin_port, timeout=10)
    try:
        conn.request("POST", "/lookup", body=deep)
        response = conn.getresponse()
        status, reply = response.status, json.loads(response.read())
    finally:
        conn.close()
    assert status == 400 and "nested too deeply" in reply["error"]
    assert lookup(server, {"model": MODEL, "tokens": TOKENS})[0] == 200


def test_the_hooks_run_off_the_event_loop():
    """A clear or a lookup may wait on the disk or the remote: never on the loop that
    also serves the cache port."""
    ran_on = []

    def lookup(body):
        ran_on.append(threading.get_ident())
        return {"cached_tokens": len(body["tokens"])}

    hooks = AdminHooks(snapshot=dict, tiers=dict, clear=len, lookup=lookup, token=None)

    def post_lookup(port):
        data = json.dumps({"tokens": [1, 2]}).encode()
        url = f"http://127.0.0.1:{port}/lookup"
        with urllib.request.urlopen(urllib.request.Request(url, data), timeout=10) as reply:
            return json.loads(reply.read())

    async def serve_one_lookup():
        admin = AdminServer(hooks)
        await admin.start("127.0.0.1", 0)
        try:
            reply = await asyncio.to_thread(post_lookup, admin.port)
        finally:
            await admin.close()
        return reply, threading.get_ident()

    reply, loop_thread = asyncio.run(serve_one_lookup())
    assert reply == {"cached_tokens": 2}
    assert ran_on and loop_thread not in ran_on


def test_a_connection_without_a_request_is_closed_after_the_idle_timeout(monkeypatch):
    """Anyone who reaches the admin port could otherwise hold one of the server's file
    descriptors per connection for aiohttp's hour: its cache port and its disk share
    them."""
    monkeypatch.setattr(web, "IDLE_CONNECTION_S", 0.5)
    hooks = AdminHooks(snapshot=dict, tiers=dict, clear=len, lookup=dict, token=None)

    def closed_within(port: int, sent: bytes, seconds: float) -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=seconds) as sock:
            sock.sendall(sent)
            try:
                return sock.recv(1) == b""
            except TimeoutError:
                return False

    async def idle_connections():
        admin = AdminServer(hooks)
        await admin.start("127.0.0.1", 0)
        try:
            return await asyncio.gather(  # silent, and with its headers half sent
                asyncio.to_thread(closed_within, admin.port, b"", 5.0),
                asyncio.to_thread(closed_within, admin.port, b"GET /stats HTTP/1.1\r\n", 5.0),
            )
        finally:
            await admin.close()

    assert asyncio.run(idle_connections()) == [True, True]


def test_metrics_are_typed_as_docs_server_md_names_them():
    """Counters get ``_total`` and TYPE counter, gauges keep their name; the text parses."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvtier.server.admin import prometheus_text

    counters = [
        "requests",
        "requests_get",
        "bytes_in",
        "bytes_shm_in",
        "connections",
        "get_hits",
        "puts_refused",
        "rejects_bad_magic",
        "remote_puts_dropped",
        "shm_attached",
        "shm_refused",
        "shm_refused_too_large",
        "request_errors",
        "peer_pulls",
        "discovery_refreshes",
        "memory_evictions",
        "disk_evictions",
        "connections_idle_closed",
        "rejects_too_many_names",
    ]
    gauges = [
        "clients_connected",
        "shm_clients_connected",
        "memory_blobs",
        "memory_bytes_capacity",
        "remote_up",
        "peers_up",
        'peer_up{peer="kvtier://a:1"}',
    ]
    text = prometheus_text({name: 1.0 for name in counters + gauges})
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    for name in counters:
        assert types[f"kvtier_server_{name}"] == "counter", name
        assert f"kvtier_server_{name}_total 1.0" in text
    for name in gauges:
        assert types[f"kvtier_server_{name.partition('{')[0]}"] == "gauge", name
    assert text.count("# HELP ") == text.count("# TYPE ") == len(types)


def test_every_metric_family_has_one_help_line_in_the_docs_words(server):
    from prometheus_client.parser import text_string_to_metric_families

    server.client().put_many([("a", [b"x"])])  # requests_put, and every tier's gauges
    status, text = server.admin("/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert text.count("# HELP ") == text.count("# TYPE ") == len(families)
    for name, family in families.items():
        assert family.documentation and "docs/server.md" not in family.documentation, name
    for name in ("memory_evictions", "disk_evictions"):
        assert families[f"kvtier_server_{name}"].type == "counter", name
        assert f"kvtier_server_{name}_total 0.0" in text
    assert families["kvtier_server_memory_blobs"].type == "gauge"
    help_of = {name: family.documentation for name, family in families.items()}
    assert help_of["kvtier_server_requests_put"] == "Requests answered of op put."
    assert help_of["kvtier_server_disk_evictions"] == (
        "Blob files deleted to stay under max_local_disk_size."
    )


def test_a_fresh_servers_counters_are_exported_at_0(server):
    from kvtier.server.server import COUNTERS

    status, text = server.admin("/metrics")
    assert status == 200
    for name in ("rejects", "request_errors", "puts_refused", "get_misses"):
        assert name in COUNTERS
        assert f"kvtier_server_{name}_total 0.0" in text, name


def kvtier_status(*args):
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_status_prints_the_servers_counters(server, tmp_path):
    put(server, names(chunk_hashes(TOKENS)))
    done = kvtier_status("--server", f"127.0.0.1:{server.port}")
    assert done.returncode == 0, done.stderr
    assert f"kvtier server 127.0.0.1:{server.port}: ok" in done.stdout
    assert "6 stored" in done.stdout and "memory" in done.stdout and "disk" in done.stdout
    done = kvtier_status("--server", f"kvtier://127.0.0.1:{server.port}", "--json")
    values = json.loads(done.stdout)
    assert values["puts"] == 6 and values["disk_blobs"] == 6
    tree = tmp_path / "disk" / "kvtier-server-v1"
    files = list(tree.rglob("*.kvt"))
    assert values["disk_bytes_used"] == sum(f.stat().st_size for f in files)
    assert values["disk_directories"] == sum(1 for p in tree.rglob("*") if p.is_dir())


def test_status_shows_a_small_tier_s_use_and_the_disk_s_directories():
    values = {"disk_blobs": 9, "disk_bytes_used": 2.7e6, "disk_bytes_capacity": 2**32}
    values |= {"disk_directories": 59, "disk_evictions": 16}
    line = render("h:1", values).splitlines()[-1]
    assert line.split() == [
        "disk",
        "9",
        "blobs,",
        "2.6",
        "MiB",
        "of",
        "4.00",
        "GiB,",
        "59",
        "directories,",
        "16",
        "evictions",
    ]


def test_status_refuses_a_server_address_of_another_scheme(server, capsys):
    for scheme in ("http", "https", "redis"):
        assert main(["status", "--server", f"{scheme}://127.0.0.1:{server.port}"]) == 2
        err = capsys.readouterr().err
        assert f"--server '{scheme}://127.0.0.1:{server.port}': expected HOST:PORT" in err
        assert f"{scheme}:// is" in err
        assert main(["serve", "--peer", f"{scheme}://127.0.0.1:1"]) == 2
        assert "--peer / server_peers" in capsys.readouterr().err
    for form in (f"127.0.0.1:{server.port}", f"lm://127.0.0.1:{server.port}"):
        assert main(["status", "--server", form, "--json"]) == 0


def test_a_dead_remote_is_warned_at_start_and_health_and_status_agree():
    """``--remote-url`` pointing at nothing: one start-up warning, ``/health`` degraded,
    ``kvtier status`` degraded with exit 1, before any request touched the remote."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    with KVTierServerProcess("--remote-url", dead, admin=True) as server:
        assert "remote redis://127.0.0.1" in server.log() and "is unavailable" in server.log()
        code, health = server.admin("/health")
        assert code == 200  # degraded still serves: memory and disk answer
        assert health["status"] == "degraded" and health["tiers"]["remote"]["up"] is False
        done = kvtier_status("--server", f"127.0.0.1:{server.port}")
        assert done.returncode == 1, done.stdout + done.stderr
        assert f"kvtier server 127.0.0.1:{server.port}: degraded" in done.stdout


def test_status_of_an_unreachable_or_refusing_server_exits_2():
    done = kvtier_status("--server", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert done.returncode == 2 and "kvtier server" in done.stderr
    with KVTierServerProcess("--auth-token", "s3cret", token="s3cret") as server:
        done = kvtier_status("--server", f"127.0.0.1:{server.port}", "--auth-token", "wrong")
        assert done.returncode == 2 and "unauthenticated" in done.stderr
        done = kvtier_status("--server", f"127.0.0.1:{server.port}", "--auth-token", "s3cret")
        assert done.returncode == 0
    assert kvtier_status("--server", "no-port-here").returncode == 2
