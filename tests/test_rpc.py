"""The scheduler <-> worker RPC over real ipc sockets in a per-test tmp dir."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.integration.vllm.rpc import (
    RankLookup,
    RpcClient,
    RpcServer,
    endpoint_for,
    runtime_dir,
)

TIMEOUT = 2.0  # generous where the call is expected to succeed
SHORT = 0.3  # where the call is expected to time out


def _echo(args: dict[str, Any]) -> dict[str, Any]:
    if args.get("sleep"):
        time.sleep(args["sleep"])
    return {"value": args.get("value")}


def _boom(args: dict[str, Any]) -> dict[str, Any]:
    raise ValueError("boom")


HANDLERS = {"echo": _echo, "boom": _boom}


def _rank_handler(rank: int, delay: float):
    def handler(args: dict[str, Any]) -> dict[str, Any]:
        time.sleep(delay)
        return {"rank": rank}

    return handler


@pytest.fixture
def servers() -> Iterator[list[RpcServer]]:
    """Closes whatever servers a test appends."""
    started: list[RpcServer] = []
    yield started
    for server in started:
        server.close()


def _serve(servers: list[RpcServer], endpoint: str, handlers=HANDLERS) -> RpcServer:
    server = RpcServer(endpoint, handlers)
    server.start()
    servers.append(server)
    return server


def _ipc_path(endpoint: str) -> str:
    assert endpoint.startswith("ipc://"), endpoint
    return endpoint[len("ipc://") :]


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_round_trip_in_endpoint_order(tmp_path: Path, servers, num_ranks: int):
    endpoints = [endpoint_for("eng", rank, str(tmp_path)) for rank in range(num_ranks)]
    for rank, endpoint in enumerate(endpoints):
        # Rank 0 answers last, so the order must come from the endpoints, not arrival.
        _serve(
            servers, endpoint, {"rank": _rank_handler(rank, delay=0.05 * (num_ranks - 1 - rank))}
        )
    with RpcClient(endpoints, TIMEOUT) as client:
        first = client.call_all("rank")
        second = client.call_all("rank")
    assert first is not None and second is not None
    assert [reply["rank"] for reply in first] == list(range(num_ranks))
    assert {reply["id"] for reply in first} != {reply["id"] for reply in second}
    assert client.timeouts == client.errors == 0


def test_handler_error_is_none_and_server_keeps_serving(tmp_path: Path, servers, caplog):
    endpoint = endpoint_for("eng", 0, str(tmp_path))
    _serve(servers, endpoint)
    with caplog.at_level(logging.ERROR), RpcClient([endpoint], TIMEOUT) as client:
        assert client.call_all("boom") is None
        assert client.call_all("boom") is None
        assert client.errors == 2
        assert client.call_all("echo", value=7)[0]["value"] == 7
    logged = [r for r in caplog.records if "handler 'boom' failed" in r.getMessage()]
    assert len(logged) == 1, "a failing handler is logged once per op, not per call"


def test_one_failing_rank_fails_the_call(tmp_path: Path, servers):
    endpoints = [endpoint_for("eng", rank, str(tmp_path)) for rank in range(2)]
    _serve(servers, endpoints[0])
    _serve(servers, endpoints[1], {"echo": _boom})
    with RpcClient(endpoints, TIMEOUT) as client:
        assert client.call_all("echo", value=1) is None
        assert client.errors == 1


def test_unknown_op_is_none(tmp_path: Path, servers):
    endpoint = endpoint_for("eng", 0, str(tmp_path))
    _serve(servers, endpoint)
    with RpcClient([endpoint], TIMEOUT) as client:
        assert client.call_all("no_such_op") is None
        assert client.errors == 1
        assert client.timeouts == 0


def test_server_never_started_times_out(tmp_path: Path):
    endpoint = endpoint_for("eng", 0, str(tmp_path))
    with RpcClient([endpoint], SHORT) as client:
        start = time.monotonic()
        assert client.call_all("echo", value=1) is None
        elapsed = time.monotonic() - start
        assert client.timeouts == 1
    assert elapsed < SHORT + 1.0


def test_server_started_after_client_connects(tmp_path: Path, servers):
    endpoint = endpoint_for("eng", 0, str(tmp_path))
    with RpcClient([endpoint], TIMEOUT) as client:
        _serve(servers, endpoint)
        replies = client.call_all("echo", value=3)
    assert replies is not None and replies[0]["value"] == 3


def test_late_reply_is_not_taken_for_the_next_call(tmp_path: Path, servers):
    endpoint = endpoint_for("eng", 0, str(tmp_path))
    _serve(servers, endpoint)
    timeout = 0.5
    with RpcClient([endpoint], timeout) as client:
        # The slow reply lands while the next call waits: it must be dropped, not returned.
        assert client.call_all("echo", value=1, sleep=timeout + 0.2) is None
        assert client.timeouts == 1
        replies = client.call_all("echo", value=2)
        assert replies is not None and replies[0]["value"] == 2
        assert client.stale == 1


def test_server_restart_on_same_endpoint(tmp_path: Path, servers):
    endpoint = endpoint_for("eng", 0, str(tmp_path))
    first = _serve(servers, endpoint)
    with RpcClient([endpoint], SHORT) as client:
        assert client.call_all("echo", value=1)[0]["value"] == 1
        first.close()
        assert client.call_all("echo", value=2) is None
        _serve(servers, endpoint)
        client.timeout = TIMEOUT
        replies = client.call_all("echo", value=3)
    assert replies is not None and replies[0]["value"] == 3


def test_stale_socket_file_does_not_block_bind(tmp_path: Path, servers):
    endpoint = endpoint_for("eng", 0, str(tmp_path))
    leftover = socket.socket(socket.AF_UNIX)
    leftover.bind(_ipc_path(endpoint))  # a dead server's file: bound, never unlinked
    leftover.close()
    assert os.path.exists(_ipc_path(endpoint))
    _serve(servers, endpoint)
    with RpcClient([endpoint], TIMEOUT) as client:
        assert client.call_all("echo", value=4)[0]["value"] == 4


def test_starting_a_server_removes_other_dead_servers_sockets(tmp_path: Path, servers):
    """A killed engine leaves its socket file behind; the next server started in the
    directory removes every such file that nothing listens on, and only those."""
    dead = [_ipc_path(endpoint_for(f"killed-{i}", 0, str(tmp_path))) for i in range(3)]
    for path in dead:
        leftover = socket.socket(socket.AF_UNIX)
        leftover.bind(path)
        leftover.close()
    live = endpoint_for("alive", 0, str(tmp_path))
    _serve(servers, live)
    other_file = tmp_path / "kvtier-notes.txt"
    other_file.write_text("not a socket")
    _serve(servers, endpoint_for("new", 0, str(tmp_path)))
    assert [os.path.exists(path) for path in dead] == [False, False, False]
    assert os.path.exists(_ipc_path(live)) and other_file.exists()
    with RpcClient([live], TIMEOUT) as client:
        assert client.call_all("echo", value=5)[0]["value"] == 5


def test_a_process_that_exits_without_closing_leaves_no_socket(tmp_path: Path):
    endpoint = endpoint_for("exits", 0, str(tmp_path))
    program = (
        "from kvtier.integration.vllm.rpc import RpcServer\n"
        f"RpcServer({endpoint!r}, {{}}).start()\n"
        "import sys; sys.exit(0)  # no close(): as an engine stopped by a signal\n"
    )
    subprocess.run([sys.executable, "-c", program], check=True, timeout=60)
    assert not os.path.exists(_ipc_path(endpoint))


def test_the_default_socket_directory_is_private_to_the_user(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    directory = runtime_dir()
    assert directory == str(tmp_path / "kvtier")
    assert os.stat(directory).st_mode & 0o777 == 0o700
    assert endpoint_for("e", 0).startswith(f"ipc://{directory}/kvtier-e-rank0")
    os.chmod(directory, 0o777)
    with pytest.raises(PermissionError, match="not private to this user"):
        runtime_dir()


def test_close_is_idempotent_and_removes_ipc_file(tmp_path: Path):
    endpoint = endpoint_for("eng", 0, str(tmp_path))
    with RpcServer(endpoint, HANDLERS) as server:
        server.start()
        assert os.path.exists(_ipc_path(endpoint))
        start = time.monotonic()
        server.close()
        assert time.monotonic() - start < 0.5
        assert not os.path.exists(_ipc_path(endpoint))
        server.close()
    client = RpcClient([endpoint], SHORT)
    client.close()
    client.close()
    with pytest.raises(RuntimeError):
        client.call_all("echo")


def test_endpoint_for_long_ids(tmp_path: Path):
    first = endpoint_for("a" * 300, 7, str(tmp_path))
    second = endpoint_for("a" * 299 + "b", 7, str(tmp_path))
    for endpoint in (first, second):
        assert len(_ipc_path(endpoint).encode()) < 100, endpoint
        assert os.path.dirname(_ipc_path(endpoint)) == str(tmp_path)
        assert endpoint.endswith("-rank7.sock")
    assert first != second


def test_endpoint_for_sanitizes_and_keeps_ids_apart(tmp_path: Path):
    plain = endpoint_for("engine-0", 1, str(tmp_path))
    assert plain == f"ipc://{tmp_path}/kvtier-engine-0-rank1.sock"
    slash, colon = endpoint_for("a/b", 0, str(tmp_path)), endpoint_for("a:b", 0, str(tmp_path))
    for endpoint in (slash, colon):
        name = os.path.basename(_ipc_path(endpoint))
        assert all(c.isalnum() or c in "_.-" for c in name), name
    assert slash != colon
    with pytest.raises(ValueError, match="rank"):
        endpoint_for("eng", -1, str(tmp_path))
    with pytest.raises(ValueError, match="base_dir"):
        endpoint_for("eng", 0, "/" + "d" * 120)


def test_binary_payloads_round_trip(tmp_path: Path, servers):
    endpoint = endpoint_for("eng", 0, str(tmp_path))
    _serve(servers, endpoint, {"lookup": lambda args: {"hits": args["hashes"][::2]}})
    hashes = [bytes([i]) * 16 for i in range(8)] + [b"\x00\xff" * 8]
    with RpcClient([endpoint], TIMEOUT) as client:
        replies = client.call_all("lookup", hashes=hashes)
    assert replies is not None
    assert replies[0]["hits"] == hashes[::2]
    assert all(type(h) is bytes for h in replies[0]["hits"])


@pytest.mark.parametrize(
    ("rank_1", "expected"),
    [
        ([True, False, False, True], [True, False, False, True]),
        ([True, True], [False] * 4),  # an answer of other length holds nothing
        (None, [False] * 4),  # the rank fails
    ],
)
def test_a_chunk_is_held_where_every_rank_holds_it(tmp_path: Path, servers, rank_1, expected):
    endpoints = [endpoint_for("eng", rank, str(tmp_path)) for rank in range(2)]
    _serve(servers, endpoints[0], {"held": lambda args: {"held": [True, True, False, True]}})
    answer = _boom if rank_1 is None else (lambda args: {"held": rank_1, "max_load_chunks": 3})
    _serve(servers, endpoints[1], {"held": answer})
    hashes = [bytes([i]) * 16 for i in range(4)]
    with RpcClient(endpoints, TIMEOUT) as client:
        assert RankLookup(client).held(hashes) == expected
