"""Peers: other ``kvtier serve`` processes (other nodes) that this server asks for the
chunks it misses (``kvtier serve --peer kvtier://HOST:PORT``).

::

    engine ──GET──▶ server b: memory, disk ─ miss ─▶ peers ─▶ remote (if any)
                               ▲                      │ LEASE + NIXL READ, or GET (TCP)
                               └── verified, kept ◀───┘

A server talks to a peer as a client that says ``peer: true`` in its HELLO, so the peer
answers from its own memory and disk, never asking its own peers or its remote in turn
(no loops, and a remote the servers share is asked once per miss).
Per batch of names a lookup is one EXISTS to every peer that is up, in parallel, and a
pull is one LEASE (NIXL) or one GET (TCP) per peer until every name is found, all bounded
by ``remote_timeout_ms``. A pulled blob is verified as every object crossing a process
boundary is (``kvtier.storage.wire``: its header, its key, its payload's checksum)
before anyone can read it, and kept in the memory tier unless ``--peer-cache off``.

A peer's stores (one per namespace asked of it, each with its connections) are bounded
as the remote's are (``kvtier.server.stores``): a server asked for many namespaces
keeps at most ``MAX_OPEN_STORES`` of them open per peer, whose sockets the peer counts
among its clients.

Each peer has the remote tiers' health policy (``kvtier.storage.health``): a peer that
fails or times out is down, and skipped (a miss at once), until a background ping
answers. A peer refusing the token never answers the ping. With NIXL (``--peer-transport
auto|nixl``) the bytes move with one-sided READs under a lease (``kvtier.server.nixl``,
``kvtier.server.leases``); a peer without NIXL, or whose handshake or READs fail while it
answers, is pulled over TCP, with one warning saying why.

The peers are the static ones (``--peer``) and, with discovery
(``kvtier.server.discovery``), the servers found registered in the same group:
``update`` adds a server found, as a peer like any other, and closes one no longer
listed unless it is static. The list is replaced, never changed in place, so a lookup or
a pull runs over the peers of the moment it started; a call to a peer closed meanwhile
is a miss.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.config.node_address import parse_server_address
from kvtier.memory import MemoryObj
from kvtier.observability.stats import Stats
from kvtier.server.blobs import damaged
from kvtier.server.discovery import Discovery, peer_url
from kvtier.server.nixl import Extent, NixlPlane, NixlUnavailable, RemotePool
from kvtier.server.stores import OpenStores
from kvtier.storage.blob_store import StoreUnavailable
from kvtier.storage.cpu import LocalCPUTier
from kvtier.storage.health import Health, fault_reason
from kvtier.storage.node_protocol import Op
from kvtier.storage.node_store import KVTierStore
from kvtier.storage.serde import tensor_bytes
from kvtier.warn import warn_once

logger = logging.getLogger(__name__)

PING_NAMESPACE = "kvtier-ping"
# Calls to peers at once; the pool starts a thread only when none is idle, so discovered
# peers find room without a thread per peer held from the start.
MAX_CALLS = 64
# How often a call to a peer closes the connections its other namespaces' stores hold
# past half the peer's idle timeout (the peer has closed, or is closing, its end).
SWEEP_S = 1.0


@dataclass(eq=False)
class Peer:
    """One peer: its stores (one per namespace), its health and its NIXL pool."""

    url: str
    host: str
    port: int
    health: Health | None = None
    stores: OpenStores[KVTierStore] = field(init=False)  # set by ``Peers``
    remote: RemotePool | None = None  # its pool, once handshaken
    nixl: bool = True  # False: pulled over TCP (it has no NIXL, or the handshake failed)
    static: bool = True  # False: found by discovery, dropped when no longer registered
    closed: bool = False  # no longer a peer: every call to it fails
    swept_at: float = 0.0  # when the other namespaces' stores last closed stale connections

    @property
    def is_up(self) -> bool:
        return self.health is None or self.health.is_up

    @property
    def transport(self) -> str:
        return "nixl" if self.nixl and self.remote is not None else "tcp"


class Peers:
    """The peers of this server and the pulls from them. Thread-safe.

    Args:
        urls: ``kvtier://host:port`` of each static peer.
        memory: the memory tier pulls land in (and are kept in, with ``keep``).
        stats: the server's counters (``peer_*``).
        token: the token sent in HELLO (the server's own ``--auth-token``).
        timeout_s: the most a lookup or a pull waits on peers.
        reconnect_max_s: the longest pause between pings of a peer that is down.
        plane: this server's NIXL plane, or None: every pull over TCP.
        keep: keep pulled blobs in the memory tier.
        self_url: this server's own ``kvtier://host:port``, never its own peer.
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        memory: LocalCPUTier,
        stats: Stats,
        token: str | None,
        timeout_s: float,
        reconnect_max_s: float,
        plane: NixlPlane | None,
        keep: bool = True,
        self_url: str | None = None,
    ):
        self.memory = memory
        self.stats = stats
        self.timeout_s = timeout_s
        self.reconnect_max_s = reconnect_max_s
        self.plane = plane
        self.keep = keep
        self.self_url = self_url
        self.discovery: Discovery | None = None  # set by whoever starts it; closed here
        self._token = token
        self._lock = threading.Lock()  # each peer's ``swept_at``
        self._members = threading.Lock()  # updates of the list
        static = [u for u in dict.fromkeys(peer_url(u) for u in urls) if u != self_url]
        self.peers: list[Peer] = [self._new_peer(url) for url in static]
        self._calls = ThreadPoolExecutor(
            max(MAX_CALLS, 2 * len(self.peers)), thread_name_prefix="kvtier-peers"
        )

    def _new_peer(self, url: str, static: bool = True) -> Peer:
        address = parse_server_address(url)
        peer = Peer(url, address.host, address.port, static=static)
        peer.stores = OpenStores(lambda namespace: self._open_store(peer, namespace))
        peer.health = Health(
            "peer",
            f"kvtier server: peer {peer.url}",
            lambda: self._ping(peer),
            reconnect_max_s=self.reconnect_max_s,
            logger=logger,
            on_reconnect=lambda: self._forget_pool(peer),
        )
        return peer

    # -- membership --------------------------------------------------------------------

    def update(self, found: Iterable[str]) -> None:
        """Make the peers the static ones and the servers ``found`` by discovery (this
        server left out): a server new to the list is added (up, connected at its first
        call), a discovered peer no longer found is closed. An address that is not a
        ``kvtier://host:port`` is skipped, with one warning."""
        urls = set()
        for url in found:
            try:
                if not url.startswith("kvtier://"):  # as every server registers itself
                    raise ValueError(url)
                urls.add(peer_url(url))
            except ValueError:
                warn_once(logger, f"kvtier server: peer discovery: {url!r} is no address; skipped")
        urls.discard(self.self_url)
        with self._members:
            known = {p.url for p in self.peers}
            gone = [p for p in self.peers if not p.static and p.url not in urls]
            added = [self._new_peer(url, static=False) for url in sorted(urls - known)]
            if gone or added:
                self.peers = [p for p in self.peers if p not in gone] + added
        for peer in added:
            logger.info("kvtier server: peer %s found (discovery)", peer.url)
        for peer in gone:
            logger.info("kvtier server: peer %s is no longer registered: dropped", peer.url)
            self._close_peer(peer)
            self._forget_pool(peer)

    def _close_peer(self, peer: Peer) -> None:
        peer.closed = True  # from here on no store of it opens
        assert peer.health is not None
        peer.health.close()
        peer.stores.close()

    def _open_store(self, peer: Peer, namespace: str) -> KVTierStore:
        if peer.closed:
            raise StoreUnavailable(f"peer {peer.url}: no longer a peer")
        return KVTierStore(
            peer.host,
            peer.port,
            namespace=namespace,
            token=self._token,
            timeout_s=self.timeout_s,
            max_connections=8,
            shm=False,
            peer=True,
        )

    @contextlib.contextmanager
    def _store(self, peer: Peer, namespace: str) -> Iterator[KVTierStore]:
        """The peer's store of ``namespace``, not closed before the block ends."""
        with peer.stores.using(namespace) as store:
            now = time.monotonic()
            with self._lock:
                sweep = now - peer.swept_at >= SWEEP_S
                if sweep:
                    peer.swept_at = now
            others = peer.stores.stores() if sweep else {}
            for name, other in others.items():  # a namespace asked once keeps no socket
                if name != namespace:
                    other.close_stale()
            yield store

    def _ping(self, peer: Peer) -> None:
        with self._store(peer, PING_NAMESPACE) as store:
            store.ping()

    def _forget_pool(self, peer: Peer) -> None:
        """A peer back up may be another process: handshake again before its next READ."""
        remote, peer.remote, peer.nixl = peer.remote, None, True
        if remote is not None and self.plane is not None:
            self.plane.forget(remote)

    def _fault(self, peer: Peer, what: str, exc: BaseException) -> None:
        if peer.closed:  # dropped meanwhile: nothing to count or ping
            return
        self.stats.inc("peer_errors")
        assert peer.health is not None
        peer.health.mark_down(fault_reason(what, exc, self.timeout_s))

    # -- lookups -----------------------------------------------------------------------

    def exists_many(self, namespace: str, names: Sequence[str]) -> list[bool]:
        """Which of ``names`` some peer that is up holds: one EXISTS per peer, in
        parallel, within the timeout (a peer that does not answer in time counts as
        holding none, and is down until it answers a ping)."""
        present = [False] * len(names)
        peers = [p for p in self.peers if p.is_up]
        if not names or not peers:
            return present
        self.stats.inc("peer_lookups")
        futures = {self._calls.submit(self._exists, p, namespace, names): p for p in peers}
        done, late = wait(futures, timeout=self.timeout_s)
        for future in late:
            future.cancel()
            self._fault(futures[future], "exists", TimeoutError())
        for future in done:
            try:
                found = future.result()
            except Exception as exc:
                self._fault(futures[future], "exists", exc)
                continue
            present = [a or b for a, b in zip(present, found, strict=True)]
        self.stats.inc("peer_lookup_hits", sum(present))
        return present

    def _exists(self, peer: Peer, namespace: str, names: Sequence[str]) -> list[bool]:
        with self._store(peer, namespace) as store:
            return store.exists_many(names)

    # -- pulls -------------------------------------------------------------------------

    def pull(self, namespace: str, names: Sequence[str]) -> dict[str, MemoryObj]:
        """The blobs of ``names`` that peers hold, verified, each in a buffer of the
        memory tier with a reference for the caller (a blob of n bytes: the first n of
        a uint8 buffer of n + 1, as the memory tier keeps blobs), kept in the tier as
        well unless ``keep`` is off. Within the timeout; what is not found is absent."""
        deadline = time.monotonic() + self.timeout_s
        out: dict[str, MemoryObj] = {}
        wanted = list(dict.fromkeys(names))
        for peer in self.peers:
            if not wanted or time.monotonic() >= deadline:
                break
            if not peer.is_up:
                continue
            got = self._pull_from(peer, namespace, wanted, deadline)
            out |= got
            wanted = [n for n in wanted if n not in got]
        self.stats.inc("peer_pulls")
        self.stats.inc("peer_hits", len(out))
        self.stats.inc("peer_misses", len(set(names)) - len(out))
        if self.keep:
            for name, obj in out.items():
                self.memory.replace((namespace, name), obj)
        return out

    def _pull_from(
        self, peer: Peer, namespace: str, names: list[str], deadline: float
    ) -> dict[str, MemoryObj]:
        """One peer's share of a pull, bounded by ``deadline``: a fault is a miss (and
        the peer down)."""
        nixl = self.plane is not None and peer.nixl
        how = self._pull_nixl if nixl else self._pull_tcp
        future: Future = self._calls.submit(how, peer, namespace, names, deadline)
        try:
            return future.result(timeout=max(deadline - time.monotonic(), 0.0))
        except Exception as exc:
            future.add_done_callback(_release_late)
            self._fault(peer, "pull", exc)
            return {}

    def _pull_tcp(
        self, peer: Peer, namespace: str, names: list[str], deadline: float
    ) -> dict[str, MemoryObj]:
        taken: list[MemoryObj] = []

        def take(blob: memoryview) -> MemoryObj | None:
            obj = self._allocate(len(blob))
            if obj is not None:
                taken.append(obj)
                tensor_bytes(obj.tensor)[: len(blob)] = blob
            return obj

        try:
            with self._store(peer, namespace) as store:
                found = store.read_many(names, take)
        except BaseException:  # the peer went away mid-reply: let go of what arrived
            for obj in taken:
                obj.ref_down()
            raise
        out = self._verified(
            peer, namespace, {n: o for n, o in zip(names, found, strict=True) if o}
        )
        self.stats.inc("peer_bytes_tcp", sum(obj.data_nbytes - 1 for obj in out.values()))
        return out

    def _pull_nixl(
        self, peer: Peer, namespace: str, names: list[str], deadline: float
    ) -> dict[str, MemoryObj]:
        with self._store(peer, namespace) as store:
            limit = store.max_names
            if limit is None or len(names) <= limit:
                return self._pull_leased(peer, store, namespace, names, deadline)
            out: dict[str, MemoryObj] = {}
            for start in range(0, len(names), limit):  # a lease per request the peer takes
                batch = names[start : start + limit]
                out |= self._pull_leased(peer, store, namespace, batch, deadline)
            return out

    def _pull_leased(
        self, peer: Peer, store: KVTierStore, namespace: str, names: list[str], deadline: float
    ) -> dict[str, MemoryObj]:
        plane = self.plane
        assert plane is not None
        reply = store.call(Op.LEASE, {"names": names})
        if "lease" not in reply:  # the peer has no NIXL
            return self._fall_back(peer, namespace, names, deadline, str(reply.get("reason")))
        lease = reply["lease"]
        objs: dict[str, MemoryObj] = {}
        try:
            sizes, offsets = _leased(reply, len(names))
            remote = peer.remote  # this pull's, whatever another pull makes of the peer's
            if remote is None or (remote.agent, remote.epoch) != (
                reply.get("agent"),
                reply.get("epoch"),
            ):
                try:
                    remote = peer.remote = plane.add_peer(store.call(Op.PEER, {}), remote)
                except NixlUnavailable as exc:
                    return self._fall_back(peer, namespace, names, deadline, str(exc))
                self.stats.inc("peer_handshakes")
            extents = []
            for name, size, offset in zip(names, sizes, offsets, strict=True):
                obj = self._allocate(size) if size >= 0 else None
                if obj is not None:
                    objs[name] = obj
                    extents.append(Extent(offset, obj.offset, size))
            status = plane.read(remote, extents, deadline) if extents else "done"
        except BaseException:
            for obj in objs.values():
                obj.ref_down()
            raise
        finally:
            held = self._release(store, lease)
        if status == "stuck":
            self.stats.inc("peer_nixl_stuck", len(objs))
            objs.clear()  # never returned to the pool: a late write may still land
            raise StoreUnavailable(f"peer {peer.url}: a READ could not be cancelled")
        if status != "done" or not held:
            self.stats.inc("peer_lease_lost" if status == "done" else "peer_nixl_failed")
            for obj in objs.values():
                obj.ref_down()
            if status != "done":
                plane.forget(remote)
                peer.remote = None
                if held and time.monotonic() < deadline:  # the peer answers; its READs fail
                    return self._fall_back(peer, namespace, names, deadline, "a READ failed")
            return {}
        out = self._verified(peer, namespace, objs)
        self.stats.inc("peer_bytes_nixl", sum(obj.data_nbytes - 1 for obj in out.values()))
        return out

    def _fall_back(
        self, peer: Peer, namespace: str, names: list[str], deadline: float, why: str
    ) -> dict[str, MemoryObj]:
        warn_once(logger, f"kvtier server: peer {peer.url}: no NIXL ({why}); pulls go over TCP")
        peer.nixl = False
        self.stats.inc("peer_fallbacks")
        return self._pull_tcp(peer, namespace, names, deadline)

    def _release(self, store: KVTierStore, lease: Any) -> bool:
        try:
            return store.call(Op.RELEASE, {"lease": lease}).get("held") is True
        except StoreUnavailable:
            return False

    def _allocate(self, size: int) -> MemoryObj | None:
        obj = self.memory.allocate((size + 1,), torch.uint8)
        if obj is None:
            self.stats.inc("peer_no_room")
        return obj

    def _verified(
        self, peer: Peer, namespace: str, objs: dict[str, MemoryObj]
    ) -> dict[str, MemoryObj]:
        """The pulled blobs that are not ``damaged`` (those of a newer kvtier's format
        pass: the engines that read them check them); the others are counted, let go
        (misses) and reported to the peer, which drops those that fail there too."""
        out, corrupt = {}, []
        for name, obj in objs.items():
            if not damaged(tensor_bytes(obj.tensor)[:-1], name):
                out[name] = obj
                continue
            self.stats.inc("peer_corrupt")
            warn_once(logger, f"kvtier server: peer {peer.url} sent a corrupt {name}: a miss")
            obj.ref_down()
            corrupt.append(name)
        if corrupt:
            with suppress(RuntimeError):  # closing: nobody to tell
                self._calls.submit(self._report_corrupt, peer, namespace, corrupt)
        return out

    def _report_corrupt(self, peer: Peer, namespace: str, names: list[str]) -> None:
        """Tell the peer which blobs it sent corrupt (off the pull's path; a report that
        fails is only logged: the next pull finds them again). A peer of an earlier
        kvtier, which takes no reports, is not sent one."""
        try:
            with self._store(peer, namespace) as store:
                if not store.answers(Op.CORRUPT):
                    warn_once(
                        logger,
                        f"kvtier server: peer {peer.url} (an earlier kvtier) "
                        "takes no reports of corrupt blobs: none sent",
                    )
                    return
                store.call(Op.CORRUPT, {"names": names})
        except StoreUnavailable as exc:
            warn_once(logger, f"kvtier server: peer {peer.url}: corrupt blobs not reported: {exc}")
            return
        self.stats.inc("peer_corrupt_reported", len(names))

    # -- status ------------------------------------------------------------------------

    def status(self) -> dict[str, dict[str, Any]]:
        """Each peer's state, by URL (for /health and ``kvtier status``)."""
        return {
            p.url: {
                "up": p.is_up,
                "transport": p.transport,
                "source": "static" if p.static else "discovery",
            }
            for p in self.peers
        }

    def gauges(self) -> dict[str, float]:
        peers = self.peers
        out: dict[str, float] = {
            "peers_configured": len(peers),
            "peers_up": sum(p.is_up for p in peers),
        }
        for p in peers:  # a label value escaped as Prometheus text wants it
            label = p.url.replace("\\", "\\\\").replace('"', '\\"')
            out[f'peer_up{{peer="{label}"}}'] = int(p.is_up)
        if self.discovery is not None:
            out["peers_discovered"] = sum(not p.static for p in peers)
            out |= self.discovery.gauges()
        return out

    def describe(self) -> str:
        plane = "NIXL" if self.plane is not None else "TCP"
        cache = "kept" if self.keep else "not kept"
        urls = ", ".join(p.url for p in self.peers) or "none yet"
        found = f"; {self.discovery.describe()}" if self.discovery is not None else ""
        return f"peers {urls} ({plane}, pulls {cache}){found}"

    def close(self) -> None:
        """Deregister (with discovery) and close every peer."""
        if self.discovery is not None:
            self.discovery.close()
        with self._members:
            peers, self.peers = self.peers, []
        for peer in peers:
            self._close_peer(peer)
        self._calls.shutdown(wait=False, cancel_futures=True)


def _leased(reply: dict[str, Any], count: int) -> tuple[list[int], list[int]]:
    sizes, offsets = reply.get("sizes"), reply.get("offsets")
    if not (
        isinstance(sizes, list)
        and isinstance(offsets, list)
        and len(sizes) == len(offsets) == count
        and all(type(v) is int for v in sizes + offsets)
    ):
        raise StoreUnavailable("LEASE: a malformed reply")
    return sizes, offsets


def _release_late(future: Future) -> None:
    """Return the buffers of a pull that finished after its caller stopped waiting."""
    if future.cancelled() or future.exception() is not None:
        return
    for obj in future.result().values():
        obj.ref_down()
