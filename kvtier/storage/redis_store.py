"""Redis / Valkey remote store: a thin, batched ``BlobStore`` client.

Each blob lives under the Redis key ``namespace + name``. Every batched call is one
pipelined round trip (``transaction=False``, so a cluster pipeline may fan out to several
nodes); only split values (below) and ``delete_many`` need a second one.

URL forms: ``redis_url`` (``redis://``, ``rediss://`` for TLS, ``unix://``,
``redis-cluster://``; ``valkey*`` schemes are aliases).

Values larger than ``max_value_bytes`` are split into parts under a manifest, and a key
holding a value of another kind is a corrupt blob, not a failure (``redis_values``).

NOTE: Python's ``socket.sendall`` applies ``timeout_s`` to a whole value, so one value
(at most ``max_value_bytes``) must reach the server within ``timeout_s``.

Connections come from one pool per store (one per node in cluster mode); at most
``max_connections`` calls run at once and a caller beyond that waits up to ``timeout_s``
for a free slot. redis-py's retries are disabled: a failed call raises
``StoreUnavailable`` at once, and the layer above (``RemoteTier``) decides when to retry.
The pool reconnects by itself on the next call once the server is back.
An ACL user denied a write (``NOPERM``), or a read-only replica (``READONLY``), gets
``WriteDenied``: it still serves lookups and loads. A user denied ``PING`` is up when
the server answers.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AskError,
    ClusterCrossSlotError,
    NoPermissionError,
    OutOfMemoryError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.retry import Retry

from kvtier.config.redis_url import check_tls_files, parse_url
from kvtier.storage.blob_store import Buffer, StoreUnavailable, WriteDenied, WriteRefused, batches
from kvtier.storage.redis_values import (
    MANIFEST_MAGIC,
    MANIFEST_PROBE_BYTES,
    PART_SEP,
    Manifest,
    replies,
)
from kvtier.storage.remote import RemoteRequest, RemoteTier, open_blob_tier

log = logging.getLogger(__name__)

SCRATCH_BYTES = 64 * 2**20  # most bytes joined into one pipeline (per writer thread)

# Keys per SCAN page and per UNLINK pipeline in clear().
_SCAN_BATCH = 1000
# The calls that change keys: an ACL error on one of them is a refused write.
_WRITES = frozenset({"put_many", "delete_many", "clear"})
# The commands the store sends (named in the error of an ACL user without one of them).
_NEEDED_COMMANDS = "GET, SET, EXISTS, GETRANGE, DEL, UNLINK, SCAN (clear only), PING"
_AUTH_HINT = " (check remote_password, remote_username or the user:password in remote_url)"
_CLUSTER_HINT = (
    "remote_url names a node of a Redis Cluster: write redis-cluster://host:port[,...] "
    "(rediss-cluster:// with TLS)"
)


def _byte_view(blob: bytes | memoryview) -> bytes | memoryview:
    """``blob`` as something whose ``len`` is its size in bytes, as redis-py assumes."""
    if isinstance(blob, memoryview):
        if not blob.c_contiguous:
            return blob.tobytes()
        if blob.ndim != 1 or blob.format != "B":
            return blob.cast("B")
    return blob


def _joined_bytes(parts: Sequence[Buffer]) -> int:
    """Bytes ``_join_batch`` copies for one blob (a single part is sent as it is)."""
    return sum(len(p) for p in parts) if len(parts) > 1 else 0


def _hint(exc: BaseException, cluster: bool) -> str:
    """What to check, for a failure a setting causes; else ``""``."""
    if isinstance(exc, redis.AuthenticationError):
        return _AUTH_HINT
    # MOVED, ASK or CROSSSLOT from a server kvtier took for a single one: a cluster node
    moved = isinstance(exc, AskError | ClusterCrossSlotError)
    return f" ({_CLUSTER_HINT})" if moved and not cluster else ""


def _is_cluster_node(client: redis.Redis) -> bool:
    """Whether the server is a node of a Redis Cluster (False where INFO is refused: an
    ACL user without it, a proxy)."""
    try:
        return bool(client.info("cluster").get("cluster_enabled"))
    except ResponseError:
        return False


def _primaries(client: redis.Redis | RedisCluster) -> list[redis.Redis]:
    """The nodes whose keys make up the whole keyspace: a cluster's primaries, or one."""
    if isinstance(client, RedisCluster):
        return [node.redis_connection for node in client.get_primaries()]
    return [client]


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis MATCH pattern."""
    return "".join("\\" + c if c in "\\*?[]" else c for c in text)


class RedisStore:
    """A ``BlobStore`` on Redis or Valkey (standalone, TLS, Unix socket or cluster).

    Args:
        url: the ``remote_url`` (see the module docstring).
        namespace: prefix of every key; must not be empty (``clear`` deletes under it).
        timeout_s: socket connect and read/write timeout, and the longest wait for a
            free connection.
        username, password: credentials; they win over those in the URL.
        ttl_s: expiry of every stored blob (and its parts), or None for none.
        max_connections: the most calls running at once (one connection each, per node).
        tls_ca_file, tls_cert_file, tls_key_file: CA bundle and client certificate for
            ``rediss://``; tls_verify=False skips certificate and host name checks.
        max_value_bytes: values above this are split into parts of this size.

    Raises:
        ValueError: a bad URL (naming ``remote_url``), a TLS file that cannot be loaded
            (naming its ``remote_tls_*`` key) or a bad argument. The constructor does not
            connect: a server that is down shows at the first call.
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "kvtier:",
        timeout_s: float = 1.0,
        username: str | None = None,
        password: str | None = None,
        ttl_s: float | None = None,
        max_connections: int = 32,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        tls_verify: bool = True,
        max_value_bytes: int = 256 * 2**20,
    ) -> None:
        endpoint = parse_url(url)
        if not namespace:
            raise ValueError("namespace must not be empty: clear() deletes every key under it")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if max_value_bytes < 1:
            raise ValueError(f"max_value_bytes must be >= 1, got {max_value_bytes}")
        tls_files = {
            "tls_ca_file": tls_ca_file,
            "tls_cert_file": tls_cert_file,
            "tls_key_file": tls_key_file,
        }
        given = [key for key, value in tls_files.items() if value is not None]
        if given and not endpoint.tls:
            raise ValueError(
                f"{', '.join(given)} set but remote_url {endpoint.display!r} is not TLS; "
                "use rediss:// (or valkeys://, rediss-cluster://)"
            )
        if endpoint.tls:
            check_tls_files(tls_ca_file, tls_cert_file, tls_key_file)

        self.url = endpoint.display
        self.namespace = namespace
        self._endpoint = endpoint
        self._scratch = threading.local()  # per writer thread: see _join_batch
        self._timeout_s = timeout_s
        self._ttl_ms = None if ttl_s is None else max(1, math.ceil(ttl_s * 1000))
        self._max_value_bytes = max_value_bytes
        self._max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._closed = False

        self._conn_kwargs: dict[str, Any] = {
            "username": username if username is not None else endpoint.username,
            "password": password if password is not None else endpoint.password,
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            # RESP2: every Redis, Valkey and proxy speaks it; redis-py 8 defaults to RESP3
            # (HELLO 3), which Redis < 6 and some proxies refuse, and which turns on
            # push-based extras (maintenance notifications) a blob store does not need.
            "protocol": 2,
        }
        if endpoint.tls:
            self._conn_kwargs |= {
                "ssl_ca_certs": tls_ca_file,
                "ssl_certfile": tls_cert_file,
                "ssl_keyfile": tls_key_file,
                "ssl_cert_reqs": "required" if tls_verify else "none",
                "ssl_check_hostname": tls_verify,
            }

        self._pool: redis.ConnectionPool | None = None
        self._client: redis.Redis | RedisCluster | None = None
        self._cluster_lock = threading.Lock()
        if not endpoint.cluster:
            self._pool = self._make_pool()
            self._client = redis.Redis(connection_pool=self._pool)

    def _make_pool(self) -> redis.ConnectionPool:
        endpoint = self._endpoint
        kwargs = dict(self._conn_kwargs, db=endpoint.db)
        if endpoint.unix_path is not None:
            kwargs |= {"connection_class": redis.UnixDomainSocketConnection}
            kwargs |= {"path": endpoint.unix_path}
        else:
            host, port = endpoint.nodes[0]
            kwargs |= {"host": host, "port": port, "socket_keepalive": True}
            if endpoint.tls:
                kwargs["connection_class"] = redis.SSLConnection
        # NOTE: Retry(NoBackoff(), 0): redis-py retries 3 times by default, which would
        # multiply the time a call against a dead server takes.
        return redis.ConnectionPool(
            max_connections=self._max_connections, retry=Retry(NoBackoff(), 0), **kwargs
        )

    def _connected_client(self) -> redis.Redis | RedisCluster:
        """The client; a cluster client is built on first use (it contacts the nodes)."""
        if self._client is not None:
            return self._client
        with self._cluster_lock:
            if self._client is None:
                kwargs = dict(self._conn_kwargs, ssl=self._endpoint.tls)
                self._client = RedisCluster(
                    startup_nodes=[ClusterNode(h, p) for h, p in self._endpoint.nodes],
                    retry=Retry(NoBackoff(), 0),
                    **kwargs,
                )
            return self._client

    @contextmanager
    def _call(self, op: str) -> Iterator[Any]:
        """Run one store operation: bound concurrency, translate failures."""
        if self._closed:
            raise StoreUnavailable(f"redis store {self.url}: {op}: the store is closed")
        if not self._slots.acquire(timeout=self._timeout_s):
            raise StoreUnavailable(
                f"redis store {self.url}: {op}: no free connection within "
                f"{self._timeout_s}s (max_connections={self._max_connections})"
            )
        try:
            yield self._connected_client()
        except OutOfMemoryError as exc:  # maxmemory reached under noeviction: reads go on
            raise WriteRefused(
                f"redis store {self.url}: {op} failed: {type(exc).__name__}: {exc}",
                "redis out of memory",
            ) from exc
        except (NoPermissionError, redis.ReadOnlyError) as exc:
            if op not in _WRITES:
                raise StoreUnavailable(
                    f"redis store {self.url}: {op} failed: {exc} (the ACL user of "
                    "remote_username needs the commands of kvtier's remote tier: "
                    f"{_NEEDED_COMMANDS})"
                ) from exc
            # a read-only ACL user or replica: reads go on
            denied = type(exc).__name__
            raise WriteDenied(
                f"redis store {self.url}: {op} failed: {denied}: {exc}", f"redis {denied}"
            ) from exc
        except (RedisError, RedisClusterException, OSError) as exc:
            hint = _hint(exc, self._endpoint.cluster)
            raise StoreUnavailable(
                f"redis store {self.url}: {op} failed: {type(exc).__name__}: {exc}{hint}"
            ) from exc
        finally:
            self._slots.release()

    def _key(self, name: str) -> str:
        return self.namespace + name

    def _split(self, key: str, blob: bytes | memoryview) -> list[tuple[str, Buffer]]:
        """The (key, value) writes of a split blob: parts first, the manifest last."""
        view = memoryview(blob)
        size = self._max_value_bytes
        manifest = Manifest(max(1, math.ceil(len(view) / size)), size, len(view))
        writes: list[tuple[str, Buffer]] = [
            (f"{key}{PART_SEP}{i}", view[i * size : (i + 1) * size]) for i in range(manifest.parts)
        ]
        writes.append((key, manifest.encode()))
        return writes

    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> None:
        """Store each ``(name, parts)`` (overwrites), with ``ttl_s`` if set.

        NOTE: overwriting a split blob with one of fewer parts leaves its extra parts
        behind (they expire with the TTL, and clear() removes them); kvtier names are
        content hashes, so a name is rewritten with the same bytes.
        """
        # Batches are cut at about SCRATCH_BYTES of multi-part blobs, each one pipeline,
        # so the reused join buffer stays small.
        for batch in batches(items, SCRATCH_BYTES, _joined_bytes):
            self._put_batch(batch)

    def _put_batch(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> None:
        writes: list[tuple[str, Buffer]] = []
        for (name, _), blob in zip(items, self._join_batch(items), strict=True):
            key = self._key(name)
            if len(blob) > self._max_value_bytes or blob[: len(MANIFEST_MAGIC)] == MANIFEST_MAGIC:
                writes.extend(self._split(key, blob))
            else:
                writes.append((key, blob))
        if not writes:
            return
        with self._call("put_many") as client:
            pipe = client.pipeline(transaction=False)
            for key, value in writes:
                pipe.set(key, value, px=self._ttl_ms)
            pipe.execute()

    def _join_batch(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[Buffer]:
        """Each blob as one buffer. Multi-part blobs are copied into this thread's
        scratch buffer, which is reused across calls: a fresh ``bytes`` per large value
        would page-fault its memory in on every write, about halving the throughput."""
        views = [[v for v in map(_byte_view, parts) if len(v)] for _, parts in items]
        multi = sum(sum(len(v) for v in parts) for parts in views if len(parts) > 1)
        scratch = getattr(self._scratch, "buffer", None)
        if multi and (scratch is None or len(scratch) < multi):
            scratch = self._scratch.buffer = bytearray(multi)
        out: list[Buffer] = []
        offset = 0
        for parts in views:
            if len(parts) <= 1:
                out.append(parts[0] if parts else b"")
                continue
            start = offset
            for part in parts:
                # numpy copies at memory speed; a bytearray slice assignment is ~10x slower
                target = np.frombuffer(scratch, np.uint8, len(part), offset)
                target[:] = np.frombuffer(part, np.uint8)
                offset += len(part)
            out.append(memoryview(scratch)[start:offset])
        return out

    def get_many(self, names: Sequence[str]) -> list[bytes | None]:
        """The blob under each name, or None where absent. A split blob whose manifest is
        malformed or one of whose parts is missing (evicted or expired on its own) reads
        as an empty blob: a corrupt one the layer above deletes, manifest and parts, so
        that the name stops answering EXISTS and is stored again."""
        if not names:
            return []
        keys = [self._key(name) for name in names]
        with self._call("get_many") as client:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            values: list[bytes | None] = replies(pipe, wrong_kind=b"")
            split = {
                i: Manifest.decode(value)
                for i, value in enumerate(values)
                if value is not None and value.startswith(MANIFEST_MAGIC)
            }
            if not split:
                return values
            pipe = client.pipeline(transaction=False)
            for i, manifest in split.items():
                for j in range(manifest.parts if manifest else 0):
                    pipe.get(f"{keys[i]}{PART_SEP}{j}")
            part_values = iter(replies(pipe, wrong_kind=None))
        for i, manifest in split.items():
            values[i] = self._reassemble(names[i], manifest, part_values)
        return values

    def _reassemble(
        self, name: str, manifest: Manifest | None, part_values: Iterator[bytes | None]
    ) -> bytes:
        if manifest is None:
            log.warning("redis store %s: malformed manifest under %r; a miss", self.url, name)
            return b""
        parts = [next(part_values) for _ in range(manifest.parts)]
        for j, part in enumerate(parts):
            if part is None or len(part) != manifest.part_length(j):
                return b""  # expired, evicted or overwritten: incomplete
        return b"".join(parts)  # type: ignore[arg-type]

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        """Whether each name is present (for a split blob: its manifest).

        One multi-key ``EXISTS`` first: it counts the present keys, so all or none (a hit
        or a miss of a whole prompt, the usual answers) is settled in one command and one
        reply; only a mixed answer asks per key, pipelined.
        """
        if not names:
            return []
        keys = [self._key(name) for name in names]
        with self._call("exists_many") as client:
            count = client.exists(*keys)
            if count in (0, len(keys)):
                return [bool(count)] * len(keys)
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return [bool(present) for present in pipe.execute()]

    def delete_many(self, names: Sequence[str]) -> int:
        """Delete the names and their parts; returns how many names were present."""
        if not names:
            return 0
        keys = [self._key(name) for name in names]
        with self._call("delete_many") as client:
            # Round trip 1: the first bytes of each value, to find manifests.
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.getrange(key, 0, MANIFEST_PROBE_BYTES - 1)
            heads: list[bytes] = replies(pipe, wrong_kind=b"")
            # Round trip 2: the keys, then the parts of split blobs.
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.delete(key)
            for key, head in zip(keys, heads, strict=True):
                manifest = Manifest.decode(head) if head.startswith(MANIFEST_MAGIC) else None
                for j in range(manifest.parts if manifest else 0):
                    pipe.delete(f"{key}{PART_SEP}{j}")
            deleted = pipe.execute()
        return sum(deleted[: len(keys)])

    def clear(self) -> int:
        """Delete every key under the namespace (SCAN + UNLINK, every primary of a cluster);
        returns how many blobs were deleted (parts are not counted)."""
        part_marker = PART_SEP.encode()
        prefix_len = len(self.namespace.encode())
        deleted = 0
        with self._call("clear") as client:
            for node in _primaries(client):
                batch: list[bytes] = []
                for key in self._scan(node):
                    batch.append(key)
                    if len(batch) == _SCAN_BATCH:
                        deleted += self._unlink(node, batch, prefix_len, part_marker)
                        batch = []
                if batch:
                    deleted += self._unlink(node, batch, prefix_len, part_marker)
        return deleted

    def names(self) -> list[str]:
        """Every name under the namespace (SCAN, every primary of a cluster; never KEYS)."""
        prefix_len = len(self.namespace.encode())
        with self._call("names") as client:
            keys = [key for node in _primaries(client) for key in self._scan(node)]
        names = (key[prefix_len:].decode(errors="replace") for key in keys)
        return [name for name in names if PART_SEP not in name]

    def _scan(self, node: redis.Redis) -> Iterator[bytes]:
        return node.scan_iter(match=_glob_escape(self.namespace) + "*", count=_SCAN_BATCH)

    @staticmethod
    def _unlink(node: redis.Redis, keys: list[bytes], prefix_len: int, part_marker: bytes) -> int:
        # One UNLINK per key: keys of one cluster node may sit in different slots, and a
        # multi-key UNLINK across slots fails with CROSSSLOT.
        pipe = node.pipeline(transaction=False)
        for key in keys:
            pipe.unlink(key)
        removed = pipe.execute()
        return sum(
            count
            for key, count in zip(keys, removed, strict=True)
            if part_marker not in key[prefix_len:]
        )

    def ping(self) -> None:
        """Return if the server (every primary of a cluster) answers, and lets this user
        read; else raise StoreUnavailable."""
        with self._call("ping") as client:
            try:
                if isinstance(client, RedisCluster):
                    # A cluster with one primary down still answers for the other slots;
                    # that is not a healthy store.
                    client.ping(target_nodes=RedisCluster.PRIMARIES)
                else:
                    client.ping()
            except NoPermissionError:
                pass  # an ACL user without PING: the server answered
            if not isinstance(client, RedisCluster) and _is_cluster_node(client):
                # it answers for its own slots only: every other key is a MOVED error
                raise StoreUnavailable(f"redis store {self.url}: {_CLUSTER_HINT}")
            # The commands of lookups and loads: an ACL user denied one is down (warned
            # once) rather than back up at each ping and down again at each lookup.
            pipe = client.pipeline(transaction=False)
            pipe.exists(self.namespace)
            pipe.get(self.namespace)
            replies(pipe, wrong_kind=None)

    def close(self) -> None:
        """Close every connection (idempotent); later calls raise StoreUnavailable."""
        self._closed = True
        if self._pool is not None:
            self._pool.disconnect()
        with self._cluster_lock:
            if isinstance(self._client, RedisCluster):
                self._client.close()

    def __repr__(self) -> str:
        return f"RedisStore(url={self.url!r}, namespace={self.namespace!r})"

    __str__ = __repr__


def open_store(request: RemoteRequest) -> RedisStore:
    """The blob store of a Redis/Valkey ``remote_url`` (a ``kvtier serve`` writes through
    it), under the key prefix ``kvtier:<space>:``."""
    return RedisStore(
        request.url,
        namespace=f"kvtier:{request.space}:",
        timeout_s=request.config.remote_timeout_ms / 1000,
        username=request.config.remote_username,
        password=request.config.remote_password,
        ttl_s=request.config.remote_ttl_secs,
        max_connections=request.config.remote_max_concurrency,
        tls_ca_file=request.config.remote_tls_ca_file,
        tls_cert_file=request.config.remote_tls_cert_file,
        tls_key_file=request.config.remote_tls_key_file,
    )


def open_remote(request: RemoteRequest) -> RemoteTier:
    """A Redis/Valkey ``remote_url`` as a tier (its ``RemoteOpener``, see ``schemes``)."""
    return open_blob_tier(open_store(request), request)
