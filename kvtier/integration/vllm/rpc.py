"""A tiny request/reply RPC between vLLM's scheduler and its workers, over ZeroMQ.

The scheduler process asks every worker (one per tensor-parallel rank) a question, such as
which chunk hashes its cache holds, and needs all the answers or none: one silent rank
must not hang scheduling, it only costs that step the cache hit.

Protocol (one ``ipc://`` endpoint per rank, see ``endpoint_for``):

- Request: a CBOR map ``{"op": str, "id": int, **args}``, one frame, sent by a DEALER
  socket to the rank's ROUTER socket.
- Reply: a CBOR map, the handler's dict plus ``"id"`` copied from the request; a failure
  (unknown op, handler exception, unencodable result) is ``{"id": id, "error": str}``.
- ``id`` increases with every ``call_all``; a reply whose id is not the current call's is
  a late answer to an earlier, timed-out call and is discarded.
- ``timeout`` bounds the whole call, all ranks together; any rank that misses it, errs or
  sends an undecodable reply makes the call return None.

CBOR, not pickle: unpickling runs arbitrary code, and the socket is a file any local
process may connect to. CBOR carries bytes natively (16-byte hashes stay compact), which
JSON does not.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import logging
import os
import re
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import cbor2
import zmq

from kvtier.integration.vllm.common import held_by_every_rank

logger = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], dict[str, Any]]

# Linux's sun_path holds 108 bytes, macOS's 104; stay under both with room to spare.
_MAX_SOCKET_PATH = 100
_POLL_MS = 50  # how long close() may wait for the serving thread to notice
_WARN_EVERY_S = 60.0
_SEND_HWM = 16  # requests queued to an absent or stuck rank before sends fail fast


def runtime_dir() -> str:
    """This user's directory for kvtier's sockets: ``$XDG_RUNTIME_DIR/kvtier``, else
    ``<tmp>/kvtier-<uid>``, created private (0700).

    Raises:
        PermissionError: the directory exists but another user owns it, or others may
            write to it (a socket there could be swapped by them).
    """
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    path = (
        os.path.join(xdg, "kvtier")
        if xdg
        else os.path.join(tempfile.gettempdir(), f"kvtier-{os.getuid()}")
    )
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.stat(path)
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise PermissionError(
            f"kvtier's socket directory {path} is not private to this user (owner uid "
            f"{info.st_uid}, mode {oct(info.st_mode & 0o777)}): remove it, or set "
            "XDG_RUNTIME_DIR"
        )
    return path


def remove_stale_sockets(directory: str) -> int:
    """Remove ``kvtier-*.sock`` files in ``directory`` that no process listens on (left by
    engines that were killed); returns how many."""
    removed = 0
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if not (name.startswith("kvtier-") and name.endswith(".sock")):
            continue
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except ConnectionRefusedError:  # a file, no listener: its process is gone
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed += 1
        except OSError:
            pass  # not ours to judge (not a socket, no permission): left alone
        finally:
            probe.close()
    return removed


def endpoint_for(engine_id: str, rank: int, base_dir: str | None = None) -> str:
    """The ``ipc://`` endpoint of ``rank``'s server for the engine ``engine_id``, in
    ``base_dir`` (default: this user's ``runtime_dir``).

    The id is reduced to ``[A-Za-z0-9_.-]``; when that changed it or the path would reach
    100 bytes, a hash of the full id is appended (and the readable part shortened), so
    distinct ids keep distinct paths. Raises ValueError for a negative rank or a
    ``base_dir`` too long to hold any socket name.
    """
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    base = base_dir if base_dir is not None else runtime_dir()
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)
    path = os.path.join(base, f"kvtier-{safe}-rank{rank}.sock")
    if safe != engine_id or len(path.encode()) >= _MAX_SOCKET_PATH:
        digest = hashlib.blake2b(engine_id.encode(), digest_size=6).hexdigest()
        fixed = len(os.path.join(base, f"kvtier--{digest}-rank{rank}.sock").encode())
        prefix = safe[: max(0, _MAX_SOCKET_PATH - 1 - fixed)]
        path = os.path.join(base, f"kvtier-{prefix}-{digest}-rank{rank}.sock")
        if len(path.encode()) >= _MAX_SOCKET_PATH:
            raise ValueError(f"base_dir {base!r} is too long for a unix socket path")
    return f"ipc://{path}"


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


def _decode(payload: bytes) -> dict[str, Any] | None:
    """The CBOR map in ``payload``, or None when it is not one."""
    try:
        message = cbor2.loads(payload)
    except Exception:  # whatever malformed input raises, it is a bad message
        return None
    return message if isinstance(message, dict) else None


class RpcServer:
    """Answers requests on one endpoint from a daemon thread.

    Args:
        endpoint: where to bind (``endpoint_for``); a stale ipc file is removed first.
        handlers: op name -> handler; a handler gets the request's args (without ``op``
            and ``id``) and returns a CBOR-encodable dict. It runs on the serving thread,
            one request at a time, so it must be safe to call from there.

    NOTE: binding unlinks an existing ipc file, which would also steal the endpoint from
    a live server; one endpoint belongs to one (engine, rank).
    """

    def __init__(self, endpoint: str, handlers: dict[str, Handler]):
        self.endpoint = endpoint
        self._handlers = dict(handlers)
        self._context: zmq.Context | None = None  # own context: the global one breaks across fork
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._logged_ops: set[str] = set()
        self._closed = False
        self._cleanup: Callable[[], None] | None = None  # removes the ipc file at exit

    def start(self) -> None:
        """Bind and start serving. Raises zmq.ZMQError when binding fails."""
        if self._thread is not None or self._closed:
            raise RuntimeError("RpcServer.start() may be called once, before close()")
        path = _ipc_path(self.endpoint)
        if path is not None:
            if os.path.exists(path):
                os.unlink(path)  # left by a process that died without closing
            remove_stale_sockets(os.path.dirname(path))
        self._context = zmq.Context()
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError:
            sock.close()
            self._context.term()
            self._context = None
            raise
        # The socket moves to the serving thread; Thread.start() is the memory barrier zmq asks for.
        self._thread = threading.Thread(
            target=self._serve, args=(sock,), name=f"kvtier-rpc {self.endpoint}", daemon=True
        )
        self._thread.start()
        if path is not None:
            # An engine stopped by a signal exits without shutting its connector down.
            self._cleanup = functools.partial(_unlink_quietly, path)
            atexit.register(self._cleanup)

    def _serve(self, sock: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if sock.poll(_POLL_MS, zmq.POLLIN):
                    frames = sock.recv_multipart()
                    # Everything before the last frame is the envelope (the DEALER's identity).
                    reply = self._answer(frames[-1])
                    if reply is not None:
                        sock.send_multipart([*frames[:-1], reply])
        except zmq.ZMQError as exc:
            if not self._stop.is_set():
                logger.error("kvtier rpc server %s stopped: %s", self.endpoint, exc)
        finally:
            sock.close(linger=0)

    def _answer(self, payload: bytes) -> bytes | None:
        request = _decode(payload)
        if request is None or not isinstance(request.get("id"), int):
            logger.warning("kvtier rpc server %s: dropped a malformed request", self.endpoint)
            return None
        request_id = request.pop("id")
        raw_op = request.pop("op", None)
        handler = self._handlers.get(raw_op) if isinstance(raw_op, str) else None
        op = raw_op if isinstance(raw_op, str) else repr(raw_op)  # hashable, for the log set
        if handler is None:
            if op not in self._logged_ops:
                self._logged_ops.add(op)
                logger.warning("kvtier rpc server %s: unknown op %r", self.endpoint, op)
            return cbor2.dumps({"id": request_id, "error": f"unknown op {op!r}"})
        try:
            result = handler(request)
            if not isinstance(result, dict):
                raise TypeError(f"handler returned {type(result).__name__}, not dict")
            return cbor2.dumps({**result, "id": request_id})
        except Exception as exc:
            if op not in self._logged_ops:  # once per op: a broken handler fails every call
                self._logged_ops.add(op)
                logger.exception("kvtier rpc handler %r failed", op)
            return cbor2.dumps({"id": request_id, "error": f"{type(exc).__name__}: {exc}"})

    def close(self) -> None:
        """Stop serving, close the socket and remove the ipc file. Idempotent.

        Returns within ~50 ms, or once the handler that is running returns.
        """
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._context is not None:
            self._context.term()
            path = _ipc_path(self.endpoint)
            if path is not None:
                if self._cleanup is not None:
                    atexit.unregister(self._cleanup)
                _unlink_quietly(path)

    def __enter__(self) -> RpcServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class RpcClient:
    """Asks the same question of several servers and collects every answer, or none.

    Args:
        endpoints: one per rank; connected lazily, so servers may start later or restart.
        timeout: seconds one ``call_all`` waits for all replies together (> 0).

    Counters: ``timeouts`` (endpoints that missed a deadline or could not take a request),
    ``errors`` (error replies and undecodable messages), ``stale`` (late replies dropped).
    Calls from several threads are serialised by a lock.
    """

    def __init__(self, endpoints: list[str], timeout: float):
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.timeouts = 0
        self.errors = 0
        self.stale = 0
        self._next_id = 0
        self._last_warning: dict[str, float] = {}
        self._lock = threading.Lock()
        self._context: zmq.Context | None = zmq.Context()
        self._sockets: list[zmq.Socket] = []
        self._poller = zmq.Poller()
        for endpoint in self.endpoints:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
            sock.connect(endpoint)
            self._sockets.append(sock)
            self._poller.register(sock, zmq.POLLIN)

    def call_all(self, op: str, **args: Any) -> list[dict[str, Any]] | None:
        """Send ``{"op": op, "id": .., **args}`` to every endpoint and wait for the replies.

        Returns the replies (each including ``"id"``) in endpoint order, or None when any
        endpoint timed out, answered with ``"error"`` or sent an undecodable message.
        Raises RuntimeError after ``close()``; never raises for a failing server.
        """
        with self._lock:
            if self._context is None:
                raise RuntimeError("RpcClient is closed")
            self._next_id += 1
            request_id = self._next_id
            payload = cbor2.dumps({**args, "op": op, "id": request_id})
            deadline = time.monotonic() + self.timeout
            for index, sock in enumerate(self._sockets):
                try:
                    sock.send(payload, zmq.NOBLOCK)
                except zmq.Again:  # the queue to an absent or stuck rank is full
                    self.timeouts += 1
                    self._warn(index, f"cannot send {op!r}: send queue full")
                    return None
            replies: list[dict[str, Any] | None] = [None] * len(self._sockets)
            pending = len(self._sockets)
            while pending:
                remaining_ms = (deadline - time.monotonic()) * 1000
                ready = (
                    dict(self._poller.poll(max(0, int(remaining_ms)))) if remaining_ms > 0 else {}
                )
                if not ready:
                    missing = [i for i, reply in enumerate(replies) if reply is None]
                    self.timeouts += len(missing)
                    for index in missing:
                        self._warn(index, f"no reply to {op!r} within {self.timeout}s")
                    return None
                for index, sock in enumerate(self._sockets):
                    if sock not in ready:
                        continue
                    reply = _decode(sock.recv())
                    if reply is None:
                        self.errors += 1
                        self._warn(index, f"undecodable reply to {op!r}")
                        return None
                    if reply.get("id") != request_id:
                        self.stale += 1  # answer to an earlier call that timed out
                        continue
                    if "error" in reply:
                        self.errors += 1
                        self._warn(index, f"{op!r} failed: {reply['error']}")
                        return None
                    if replies[index] is None:
                        replies[index] = reply
                        pending -= 1
            return replies  # type: ignore[return-value]  # every slot is filled here

    def _warn(self, index: int, message: str) -> None:
        # A dead rank fails every scheduling step; one line a minute per endpoint says enough.
        endpoint = self.endpoints[index]
        now = time.monotonic()
        last = self._last_warning.get(endpoint)
        if last is None or now - last >= _WARN_EVERY_S:
            self._last_warning[endpoint] = now
            logger.warning("kvtier rpc %s: %s", endpoint, message)

    def close(self) -> None:
        """Close the sockets and the context. Idempotent."""
        with self._lock:
            if self._context is None:
                return
            for sock in self._sockets:
                sock.close(linger=0)
            self._context.term()
            self._context = None

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class RankLookup:
    """The scheduler's lookup over every worker rank: how many leading chunk hashes all
    ranks hold (0 when any rank is late or fails); ``held``: which ones.

    Each reply also says how many chunks one load can stage on that rank (the CPU pool's
    size over a chunk's, ``CacheEngine.max_load_chunks``); ``max_load_chunks`` is the
    least of them from the last reply (None until one came).
    """

    def __init__(self, client: RpcClient):
        self.client = client
        self.max_load_chunks: int | None = None

    def __call__(self, hashes: list[bytes], load_from: int = 0) -> int:
        """How many leading ``hashes`` every rank holds; each rank prefetches what a load
        from chunk ``load_from`` (vLLM's own prefix, in chunks) can take."""
        replies = self._call("lookup", hashes=hashes, load_from=load_from)
        if replies is None:
            return 0
        return min(int(r.get("hits", 0)) for r in replies)

    def held(self, hashes: list[bytes]) -> list[bool]:
        """Whether every rank holds each of ``hashes`` (none when any rank is late or
        fails); nothing is prefetched."""
        return held_by_every_rank(self._call("held", hashes=hashes), len(hashes))

    def _call(self, op: str, **args: Any) -> list[dict] | None:
        replies = self.client.call_all(op, **args)
        if replies is None:
            return None
        bounds = [int(r["max_load_chunks"]) for r in replies if "max_load_chunks" in r]
        if len(bounds) == len(replies):
            self.max_load_chunks = min(bounds)
        return replies
