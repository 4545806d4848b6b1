"""Real ``kvtier serve`` processes for tests.

    with KVTierServerProcess(admin=True) as server:   # started, answers PING
        url = server.url                              # kvtier://127.0.0.1:PORT
        server.kill()        # SIGKILL: a crash; the port refuses connections
        server.start()       # the same port again (memory empty, disk kept)
        assert server.terminate() == 0                # SIGTERM: a clean stop

Each server binds 127.0.0.1 on a free port and is killed on ``close()``, on leaving the
``with`` block, or at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvtier.server.nixl import NixlUnavailable, import_nixl
from kvtier.storage.blob_store import StoreUnavailable
from kvtier.storage.node_store import KVTierStore
from support.redis_server import free_port

NIXL_MISSING = "NIXL is not installed (pip install --no-deps nixl-cu13 numpy; make test does)"


def nixl_installed() -> bool:
    """Whether NIXL imports here (its peer transport can run)."""
    try:
        import_nixl()
    except NixlUnavailable:
        return False
    return True


ROOT = Path(__file__).resolve().parents[2]
__all__ = ["KVTierServerProcess", "free_port", "serve_command"]


def serve_command(*args: str) -> list[str]:
    """``kvtier serve ARGS`` as an argument list for this interpreter."""
    return [sys.executable, "-m", "kvtier.cli", "serve", *args]


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


class KVTierServerProcess:
    """A ``kvtier serve`` subprocess on a free loopback port.

    Args:
        args: more ``kvtier serve`` flags (``--local-disk``, ``--auth-token``, ...).
        admin: also serve the admin API (on another free port; see ``admin_url``).
        token: the token the helper's own client sends (for ``ready`` and ``client``).
        port: the port to bind (None: a free one), for servers that must name each
            other before either starts (peers).
    """

    def __init__(
        self, *args: str, admin: bool = False, token: str | None = None, port: int | None = None
    ):
        self.port = free_port() if port is None else port
        self.admin_port = free_port() if admin else None
        self.token = token
        self.args = [*args, "--port", str(self.port)]
        if self.admin_port is not None:
            self.args += ["--admin-port", str(self.admin_port)]
        self.process: subprocess.Popen | None = None
        # a file, not a pipe: a chatty server must never block on a full pipe
        self._dir = tempfile.TemporaryDirectory(prefix="kvtier-serve-")
        self._log = Path(self._dir.name) / "serve.log"
        try:
            self.start()
        except BaseException:
            self.close()  # a server that started but never answered
            raise
        atexit.register(self.close)

    @property
    def url(self) -> str:
        return f"kvtier://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def client(self, namespace: str = "test", timeout_s: float = 2.0) -> KVTierStore:
        return KVTierStore(
            "127.0.0.1", self.port, namespace=namespace, token=self.token, timeout_s=timeout_s
        )

    def start(self, timeout: float = 30.0) -> None:
        with open(self._log, "ab") as log:
            self.process = subprocess.Popen(
                serve_command(*self.args),
                env=_environment(),
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        deadline = time.monotonic() + timeout
        client = self.client()
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"kvtier serve exited: {self.log()}")
                try:
                    client.ping()
                    return
                except StoreUnavailable:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL (a crash); returns once the process is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM; the exit code."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def log(self) -> str:
        """What the server has written to stderr (every start)."""
        return self._log.read_text()

    def admin(self, path: str, method: str = "GET", headers: dict | None = None, body=None):
        """``(status, body)`` of an admin API request (``body``: sent as JSON); JSON
        replies are decoded."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.admin_url + path, data=data, method=method, headers=headers or {}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                status, body = response.status, response.read().decode()
                kind = response.headers.get("Content-Type", "")
        except urllib.error.HTTPError as error:
            status, body, kind = error.code, error.read().decode(), "application/json"
        return status, json.loads(body) if kind.startswith("application/json") else body

    def close(self) -> None:
        self.kill()
        with contextlib.suppress(OSError):
            self._dir.cleanup()

    def __enter__(self) -> KVTierServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
