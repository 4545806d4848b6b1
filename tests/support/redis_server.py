"""Real ``redis-server`` processes for tests: one server, TLS files, a local cluster.

A plain helper module (not a conftest), imported like the other test helpers::

    from support.redis_server import REDIS_MISSING, RedisServer, redis_available

    pytestmark = [
        pytest.mark.redis,
        pytest.mark.skipif(not redis_available(), reason=REDIS_MISSING),
    ]

    with RedisServer(password="s3cret") as server:   # started, answers PING
        store = RedisStore(server.url, password="s3cret")
        server.stop()    # SIGKILL: a crash; the port refuses connections
        server.start()   # the same port again, empty (nothing is persisted)

Every server binds 127.0.0.1 on a free port, keeps its files (log, Unix socket, cluster
config) in its own temporary directory, persists nothing (``--save "" --appendonly no``)
and is killed and its directory removed on ``close()``, on leaving the ``with`` block,
when the object is collected, or at interpreter exit, whichever comes first.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CLUSTER_MISSING",
    "REDIS_MISSING",
    "TLS_MISSING",
    "LocalRedisCluster",
    "RedisServer",
    "TlsFiles",
    "free_port",
    "make_tls_files",
    "redis_available",
    "redis_cluster_available",
    "redis_tls_available",
]

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
#: pytest skip reason when redis-server is not installed
REDIS_MISSING = "redis-server is not installed (apt-get install redis-server)"
#: pytest skip reason when TLS servers cannot be run
TLS_MISSING = "redis-server was built without TLS, or openssl is missing"
#: pytest skip reason when a local cluster cannot be formed
CLUSTER_MISSING = "redis-server/redis-cli are missing (a cluster needs both)"

_STARTUP_TIMEOUT_S = 10.0


def redis_available() -> bool:
    """Whether a ``redis-server`` binary is on PATH."""
    return REDIS_SERVER is not None


def redis_cluster_available() -> bool:
    """Whether ``redis-server`` and ``redis-cli`` (which forms clusters) are on PATH."""
    return REDIS_SERVER is not None and REDIS_CLI is not None


@functools.cache
def redis_tls_available() -> bool:
    """Whether ``openssl`` is on PATH and ``redis-server`` accepts the TLS directives."""
    if REDIS_SERVER is None or shutil.which("openssl") is None:
        return False
    # A TLS build knows ``tls-port`` and then fails for want of a certificate; a build
    # without TLS rejects the directive itself.
    probe = subprocess.run(
        [REDIS_SERVER, "--port", "0", "--tls-port", "1", "--save", ""],
        capture_output=True,
        text=True,
        timeout=10,
    )
    output = probe.stdout + probe.stderr
    return "tls-cert-file" in output and "Bad directive" not in output


_HANDED_OUT: set[int] = set()


def _ephemeral_ports() -> range:
    """The ports the kernel hands out to outgoing connections and to ``bind(0)``."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port() -> int:
    """A loopback TCP port that was free a moment ago, outside the ephemeral range.

    NOTE: a server that is killed and started again on its port (the fault tests) loses
    that port when, in between, any process's outgoing connection is given it as its
    local port; ports the kernel never hands out that way are not taken like that.
    """
    ephemeral = _ephemeral_ports()
    for port in random.sample(range(20000, 32768), 64):
        if port in ephemeral or port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)  # not twice in one process (two servers, before either binds)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """A throwaway CA and one certificate it signed (for 127.0.0.1 and localhost).

    The certificate serves as both the server's and a client's certificate.
    """

    ca_file: str
    cert_file: str
    key_file: str


def make_tls_files(directory: str | Path) -> TlsFiles:
    """Generate a CA and a server/client certificate with ``openssl`` in ``directory``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    ca_key, ca_crt = out / "ca.key", out / "ca.crt"
    key, csr, crt, ext = out / "redis.key", out / "redis.csr", out / "redis.crt", out / "ext.cnf"
    ext.write_text(
        "subjectAltName = IP:127.0.0.1, DNS:localhost\nextendedKeyUsage = serverAuth, clientAuth\n"
    )

    def openssl(*args: str | Path) -> None:
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)

    openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-keyout", ca_key, "-out", ca_crt, "-subj", "/CN=kvtier-test-ca",
    )  # fmt: skip
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
        "-subj", "/CN=localhost",
    )  # fmt: skip
    openssl(
        "x509", "-req", "-in", csr, "-CA", ca_crt, "-CAkey", ca_key, "-CAcreateserial",
        "-days", "2", "-out", crt, "-extfile", ext,
    )  # fmt: skip
    return TlsFiles(str(ca_crt), str(crt), str(key))


class _Process:
    """The process and directory of one server; what the finalizer cleans up."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.proc: subprocess.Popen[bytes] | None = None

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it may have just exited
                proc.kill()  # SIGKILL, which also ends a paused (SIGSTOP) process
            proc.wait(timeout=10)

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.directory, ignore_errors=True)


class RedisServer:
    """One real ``redis-server`` on ``127.0.0.1``, started by the constructor.

    Args:
        password: ``requirepass`` (the ``default`` user's password), or None for none.
        users: ACL users to create, ``{username: password}``, with every permission.
        tls: serve TLS only (``rediss://``) with these files; None for plain TCP.
        tls_auth_clients: with ``tls``, require a client certificate.
        port: the port to use; None picks a free one.
        extra_args: more ``--directive value`` arguments for redis-server.

    Raises:
        RuntimeError: redis-server is missing, or exited or did not answer PING within
            10 s (the message holds the end of its log).
    """

    def __init__(
        self,
        *,
        password: str | None = None,
        users: Mapping[str, str] | None = None,
        tls: TlsFiles | None = None,
        tls_auth_clients: bool = False,
        port: int | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError(REDIS_MISSING)
        self.host = "127.0.0.1"
        self.password = password
        self.users = dict(users or {})
        self.tls = tls
        self.tls_auth_clients = tls_auth_clients
        self.extra_args = list(extra_args)
        self.dir = tempfile.mkdtemp(prefix="kvtier-redis-")
        self._process = _Process(self.dir)
        self._finalizer = weakref.finalize(self, self._process.cleanup)
        # AF_UNIX paths are limited to 107 bytes; skip the socket if the temp dir is deep.
        sock = os.path.join(self.dir, "redis.sock")
        self.unix_socket: str | None = sock if len(sock) < 100 else None
        self.port = port if port is not None else free_port()
        try:
            self._start(retry_other_ports=port is None)
        except BaseException:
            self.close()
            raise

    # -- addresses --------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (``rediss://`` with TLS); no credentials."""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{self.host}:{self.port}/0"

    @property
    def unix_url(self) -> str:
        """``unix:///…/redis.sock`` (raises when the path was too long to create)."""
        if self.unix_socket is None:
            raise RuntimeError("this server has no Unix socket (temporary path too long)")
        return f"unix://{self.unix_socket}"

    @property
    def pid(self) -> int | None:
        proc = self._process.proc
        return proc.pid if proc is not None else None

    @property
    def running(self) -> bool:
        proc = self._process.proc
        return proc is not None and proc.poll() is None

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        """(Re)start on the same port and wait until it answers PING; no-op if running."""
        if not self.running:
            self._start(retry_other_ports=False)

    def stop(self) -> None:
        """Kill the server with SIGKILL (a crash: no shutdown, nothing saved)."""
        self._process.kill()

    def pause(self) -> None:
        """SIGSTOP the server: connections are accepted by the kernel, never answered."""
        assert self._process.proc is not None, "the server is not running"
        self._process.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        assert self._process.proc is not None, "the server is not running"
        self._process.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        """Kill the server and remove its directory (idempotent)."""
        self._finalizer()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RedisServer({self.url}, pid={self.pid})"

    # -- helpers for tests ------------------------------------------------------------

    def client(self, **kwargs: Any):
        """A ``redis.Redis`` on this server, logged in as ``default`` (``requirepass``).

        Keyword arguments override the defaults (e.g. ``db=3``, ``username=...``).
        """
        import redis

        options: dict[str, Any] = {"password": self.password, "socket_timeout": 5.0}
        if self.tls:
            options |= {
                "ssl": True,
                "ssl_ca_certs": self.tls.ca_file,
                "ssl_certfile": self.tls.cert_file,
                "ssl_keyfile": self.tls.key_file,
            }
        return redis.Redis(host=self.host, port=self.port, **(options | kwargs))

    def wait_synced(self, timeout_s: float = 10.0) -> None:
        """Wait until this replica has loaded its master's data (until then it answers
        LOADING, or serves what it held before the sync)."""
        client = self.client()
        deadline = time.monotonic() + timeout_s
        while True:
            info = client.info("replication") | client.info("persistence")
            if info.get("master_link_status") == "up" and not info.get("loading"):
                return
            assert time.monotonic() < deadline, f"replica {self.url} did not sync: {info}"
            time.sleep(0.05)

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the server's log."""
        try:
            text = Path(self.dir, "redis.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # -- internals --------------------------------------------------------------------

    def _args(self) -> list[str]:
        assert REDIS_SERVER is not None
        args = [REDIS_SERVER, "--bind", self.host, "--dir", self.dir, "--daemonize", "no"]
        args += ["--save", "", "--appendonly", "no", "--logfile", "redis.log"]
        if self.tls:
            args += ["--port", "0", "--tls-port", str(self.port)]
            args += ["--tls-cert-file", self.tls.cert_file, "--tls-key-file", self.tls.key_file]
            args += ["--tls-ca-cert-file", self.tls.ca_file]
            args += ["--tls-auth-clients", "yes" if self.tls_auth_clients else "no"]
        else:
            args += ["--port", str(self.port)]
        if self.unix_socket:
            args += ["--unixsocket", self.unix_socket, "--unixsocketperm", "700"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        for user, secret in self.users.items():
            args += ["--user", user, "on", f">{secret}", "~*", "&*", "+@all"]
        return args + self.extra_args

    def _start(self, *, retry_other_ports: bool) -> None:
        for attempt in range(3):
            self._process.proc = subprocess.Popen(
                self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
            )
            try:
                self._wait_ready()
                return
            except RuntimeError:
                self._process.kill()
                # The port picked by free_port() can be taken before the server binds it.
                in_use = "Address already in use" in self.log_tail()
                if not (in_use and retry_other_ports and attempt < 2):
                    raise
                self.port = free_port()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            proc = self._process.proc
            if proc is None or proc.poll() is not None:
                raise RuntimeError(f"redis-server exited at startup:\n{self.log_tail()}")
            if self._answers_ping():
                return
            time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer PING in time:\n{self.log_tail()}")

    def _answers_ping(self) -> bool:
        """Whether the server answers PING (``-NOAUTH`` counts: it is up)."""
        try:
            with socket.create_connection((self.host, self.port), timeout=1.0) as raw:
                sock: socket.socket = raw
                if self.tls:
                    context = ssl.create_default_context(cafile=self.tls.ca_file)
                    context.load_cert_chain(self.tls.cert_file, self.tls.key_file)
                    sock = context.wrap_socket(raw, server_hostname=self.host)
                sock.sendall(b"PING\r\n")
                reply = sock.recv(64)
                return reply.startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False


class LocalRedisCluster:
    """A Redis Cluster of ``primaries`` local servers (no replicas), formed and ready.

    Forming takes about 2 s (``redis-cli --cluster create`` polls once a second).

    Args:
        primaries: how many primary nodes (at least 3, as Redis Cluster requires).
        tls: serve clients and the cluster bus over TLS only (``rediss-cluster://``).

    Raises:
        RuntimeError: a server did not start or the cluster did not reach
            ``cluster_state:ok`` within 20 s.
    """

    def __init__(self, primaries: int = 3, *, tls: TlsFiles | None = None) -> None:
        if not redis_cluster_available():
            raise RuntimeError(CLUSTER_MISSING)
        self.servers: list[RedisServer] = []
        try:
            # NOTE: the cluster bus port is given explicitly: the default (port + 10000)
            # may be taken or beyond 65535.
            cluster_args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            cluster_args += ["--cluster-node-timeout", "2000"]
            if tls:
                cluster_args += ["--tls-cluster", "yes"]
            for _ in range(primaries):
                bus_port = ["--cluster-port", str(free_port())]
                self.servers.append(RedisServer(tls=tls, extra_args=cluster_args + bus_port))
            self._create()
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        """``redis-cluster://127.0.0.1:P1,127.0.0.1:P2,...`` (every node a startup node;
        ``rediss-cluster://`` with TLS)."""
        scheme = "rediss-cluster" if self.servers[0].tls else "redis-cluster"
        return f"{scheme}://" + ",".join(f"{s.host}:{s.port}" for s in self.servers)

    def clients(self) -> list[Any]:
        """One plain ``redis.Redis`` per node (to look at what each node holds)."""
        return [server.client() for server in self.servers]

    def close(self) -> None:
        """Kill every node and remove their directories (idempotent)."""
        for server in self.servers:
            server.close()

    def __enter__(self) -> LocalRedisCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        assert REDIS_CLI is not None
        nodes = [f"{s.host}:{s.port}" for s in self.servers]
        create = [REDIS_CLI, "--cluster", "create", *nodes, "--cluster-replicas", "0"]
        tls = self.servers[0].tls
        if tls:
            create += ["--tls", "--cacert", tls.ca_file]
            create += ["--cert", tls.cert_file, "--key", tls.key_file]
        done = subprocess.run(
            [*create, "--cluster-yes"], capture_output=True, text=True, timeout=30
        )
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{done.stdout}{done.stderr}")
        deadline = time.monotonic() + 20
        pending = list(self.servers)
        while pending:
            with pending[0].client() as client:
                state = client.cluster("INFO").get("cluster_state")
            if state == "ok":
                pending.pop(0)
            elif time.monotonic() > deadline:
                raise RuntimeError(f"cluster_state is {state!r} after 20 s on {pending[0]}")
            else:
                time.sleep(0.05)
