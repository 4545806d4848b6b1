"""NIXL as the data plane between peer servers: a server's memory pool registered with a
NIXL agent, so that a peer pulls blobs with one-sided READs straight into its own pool.

::

    puller (server b)                          holder (server a)
    PEER     ───────── handshake ───────────▶  agent, epoch, metadata, pool base
    add_remote_agent(metadata)
    LEASE names ───────────────────────────▶  pin the blobs, give their pool offsets
    READ  a's pool ─▶ b's pool (NIXL, no server code runs on a)
    RELEASE lease ─────────────────────────▶  unpin; held throughout? yes / no
    verify (wire checksum), keep

NOTE: no progress thread. NIXL's UCX backend runs one per agent by default, and it costs
about 40% of a core while idle. Here the puller progresses its own transfers while it
waits for them (``check_xfer_state``), and the holder progresses its agent from one
thread only while a lease is out (some UCX transports, TCP among them, need the target
to progress), waking every ``POLL_INTERVAL_S``; with no lease out that thread sleeps on a
condition, so an idle server spends nothing on NIXL. Every call into the agent holds one
lock: the agent is created without NIXL's own thread safety.

The ``nixl`` package is imported only here, when a plane is made: ``pip install
kvtier[nixl]``, or ``pip install --no-deps nixl-cu13 numpy`` (docs/server.md).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.0005  # the holder's progress while a lease is out
WAIT_INTERVAL_S = 0.0002  # the puller's between checks of a transfer


class NixlUnavailable(Exception):
    """NIXL cannot be used here (not installed, no UCX backend, a setup failure)."""


def import_nixl() -> tuple[Any, Any]:
    """``(nixl_agent, nixl_agent_config)`` from the installed NIXL wheel.

    Raises:
        NixlUnavailable: no NIXL package is installed.
    """
    for module in ("nixl_cu13", "nixl_cu12", "nixl._api"):
        try:
            mod = __import__(module, fromlist=["nixl_agent", "nixl_agent_config"])
        except ImportError:
            continue
        return mod.nixl_agent, mod.nixl_agent_config
    raise NixlUnavailable("no NIXL package is installed (pip install 'kvtier[nixl]')")


@dataclass(frozen=True, slots=True)
class RemotePool:
    """A peer's registered pool as a PEER reply describes it."""

    agent: str
    epoch: int
    base: int


@dataclass(frozen=True, slots=True)
class Extent:
    """One blob to read: its offset in the peer's pool, its buffer's offset in ours."""

    remote_offset: int
    local_offset: int
    size: int


class NixlPlane:
    """This server's NIXL agent with its memory pool registered.

    Args:
        pool: the memory tier's whole pool (``HostMemoryPool.buffer``).
        busy: whether the holder side has work (leases out); polled by the progress
            thread, which ``wake`` starts.
        on_idle: called by the progress thread on each round (expires leases).

    Raises:
        NixlUnavailable: NIXL is not installed or its agent cannot be set up.
    """

    def __init__(
        self,
        pool: torch.Tensor,
        *,
        busy: Callable[[], bool] = lambda: False,
        on_idle: Callable[[], None] = lambda: None,
    ):
        nixl_agent, nixl_agent_config = import_nixl()
        self.name = f"kvtier-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._lock = threading.Lock()
        self._base = pool.data_ptr()
        self._size = pool.numel() * pool.element_size()
        try:
            config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            self._agent = nixl_agent(self.name, config)
            if "UCX" not in self._agent.backends:
                raise NixlUnavailable("NIXL has no UCX backend here")
            self._registered = self._register()
        except NixlUnavailable:
            raise
        except Exception as exc:
            raise NixlUnavailable(f"{type(exc).__name__}: {exc}") from None
        self.epoch = 1
        self._busy = busy
        self._on_idle = on_idle
        self._wakeup = threading.Condition()
        self._closed = False
        self._poller = threading.Thread(target=self._progress, name="kvtier-nixl", daemon=True)
        self._poller.start()

    def _register(self) -> Any:
        return self._agent.register_memory([(self._base, self._size, 0, "")], "DRAM")

    # -- holder side -------------------------------------------------------------------

    def handshake(self) -> dict[str, Any]:
        """The PEER reply: what a puller needs to read this pool."""
        with self._lock:
            metadata = self._agent.get_agent_metadata()
        return {"agent": self.name, "epoch": self.epoch, "metadata": metadata, "base": self._base}

    def reregister(self) -> None:
        """Register the pool again (a new epoch: pullers holding the old metadata
        handshake again before their next read)."""
        with self._lock:
            self._agent.deregister_memory(self._registered)
            self._registered = self._register()
            self.epoch += 1

    def wake(self) -> None:
        """Progress the agent until ``busy()`` turns false (a lease was granted)."""
        with self._wakeup:
            self._wakeup.notify()

    def _progress(self) -> None:
        while True:
            with self._wakeup:
                while not self._closed and not self._busy():
                    self._wakeup.wait()
                if self._closed:
                    return
            with self._lock:
                try:
                    self._agent.get_new_notifs()
                except Exception as exc:  # a peer gone mid-read: its reads fail there
                    logger.debug("kvtier nixl: progress: %s", exc)
            self._on_idle()
            time.sleep(POLL_INTERVAL_S)

    # -- puller side -------------------------------------------------------------------

    def add_peer(self, reply: dict[str, Any], known: RemotePool | None) -> RemotePool:
        """Load a peer's metadata from its PEER reply (dropping what ``known`` loaded).

        Raises:
            NixlUnavailable: the reply is malformed or the metadata is refused.
        """
        metadata, base, epoch = reply.get("metadata"), reply.get("base"), reply.get("epoch")
        if not (isinstance(metadata, bytes) and type(base) is int and type(epoch) is int):
            raise NixlUnavailable(f"a malformed PEER reply ({reply.get('error', 'no fields')})")
        with self._lock:
            if known is not None:
                self._forget(known.agent)
            try:
                agent = self._agent.add_remote_agent(metadata)
            except Exception as exc:
                raise NixlUnavailable(f"its metadata was refused: {exc}") from None
        name = agent.decode() if isinstance(agent, bytes) else str(agent)
        return RemotePool(name, epoch, base)

    def forget(self, remote: RemotePool) -> None:
        """Drop a peer's metadata (it died, restarted or registered its pool again)."""
        with self._lock:
            self._forget(remote.agent)

    def _forget(self, agent: str) -> None:
        try:
            self._agent.remove_remote_agent(agent)
        except Exception as exc:
            logger.debug("kvtier nixl: removing %s: %s", agent, exc)

    def read(self, remote: RemotePool, extents: Sequence[Extent], deadline: float) -> str:
        """READ ``extents`` of the peer's pool into this pool, waiting until
        ``deadline`` (``time.monotonic``).

        Returns ``"done"``; ``"failed"`` (nothing more will land in the local buffers:
        they may be reused); or ``"stuck"`` (a transfer that could not be cancelled:
        the local buffers must never be reused).
        """
        local = [(self._base + e.local_offset, e.size, 0) for e in extents]
        far = [(remote.base + e.remote_offset, e.size, 0) for e in extents]
        handle = None
        state = "ERR"
        try:
            with self._lock:
                local_descs = self._agent.get_xfer_descs(local, "DRAM")
                far_descs = self._agent.get_xfer_descs(far, "DRAM")
                handle = self._agent.initialize_xfer("READ", local_descs, far_descs, remote.agent)
                state = self._agent.transfer(handle)
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(WAIT_INTERVAL_S)
                with self._lock:
                    state = self._agent.check_xfer_state(handle)
        except Exception as exc:  # nixlRemoteDisconnectError and the like: a dead peer
            logger.debug("kvtier nixl: a READ from %s failed: %s", remote.agent, exc)
            state = "ERR"
        if handle is None:
            return "failed"
        try:
            with self._lock:
                self._agent.release_xfer_handle(handle)
        except Exception as exc:
            logger.warning("kvtier nixl: a READ from %s cannot be cancelled: %s", remote.agent, exc)
            return "stuck"
        return "done" if state == "DONE" else "failed"

    def close(self) -> None:
        with self._wakeup:
            self._closed = True
            self._wakeup.notify()
        self._poller.join(timeout=1.0)
        with self._lock:
            try:
                self._agent.deregister_memory(self._registered)
            except Exception as exc:
                logger.debug("kvtier nixl: deregistering: %s", exc)
