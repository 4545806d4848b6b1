"""A subscriber per instance to vLLM's KV event stream, applying it to the block index.

vLLM's ``ZmqEventPublisher`` (``vllm.distributed.kv_events``) sends one multipart
message per engine step on a PUB socket::

    [topic, seq (8 bytes, big-endian, from 0 per publisher), payload]

``payload`` is a msgpack ``KVEventBatch``: an array ``[ts, events, data_parallel_rank]``
whose events are maps tagged by ``"type"``: ``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``. The classes below mirror vLLM's field for field (decoding only;
unknown fields are skipped, so newer vLLM fields do no harm). With a replay endpoint
(vLLM's ROUTER socket) a subscriber asks for missed batches: it sends ``[b"", start seq]``
on a DEALER and gets ``[b"", topic, seq, payload]`` for each buffered batch from
``start`` on, then ``[b"", b"", -1 (8 bytes, signed), b""]``.

Sequence numbers, per instance:

    seq == last + 1                 applied
    seq >  last + 1 (a gap)         replay [last + 1, seq) when a replay endpoint is
                                    configured; if that fails (no answer, or the
                                    publisher's buffer no longer has them), the
                                    instance's entries are dropped, then the stream goes on
    seq <= last, not a replayed one the publisher restarted (an engine restart): its
                                    entries are dropped; with replay, rebuilt from seq 0
    the first batch ever            with replay, the history from seq 0 is asked first
                                    (a proxy started after the engines)

The subscriber runs as an asyncio task on the proxy's loop (``zmq.asyncio``); decoding a
batch and applying it take microseconds per event, between requests. A monitor socket
tells connected from disconnected.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvtier.routing.index import BlockIndex
from kvtier.tasks import cancel_and_wait

logger = logging.getLogger("kvtier.routing")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_TIMEOUT_S = 2.0


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Mirror of vLLM's base class (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


decode_batch = msgspec.msgpack.Decoder(KVEventBatch).decode


def parse_endpoint(spec: str) -> tuple[str, str | None]:
    """``tcp://host:port`` or ``tcp://host:port;replay=tcp://host:port`` -> (pub, replay).

    Raises:
        ValueError: an empty endpoint, an unknown option, or an endpoint ZMQ cannot
            connect to (not ``tcp://host:port`` or ``ipc://path``; a wildcard host).
    """
    pub, *options = (part.strip() for part in spec.split(";"))
    replay = None
    for option in options:
        name, _, value = option.partition("=")
        if name != "replay" or not value:
            raise ValueError(f"{spec!r}: the only option is ';replay=tcp://host:port'")
        replay = value
    for endpoint in (pub, replay):
        if endpoint is not None and not _connectable(endpoint):
            raise ValueError(
                f"{spec!r}: {endpoint!r} is not an endpoint to connect to; a ZMQ endpoint "
                "such as tcp://host:5557 (the engine's host as the proxy reaches it, not *)"
            )
    return pub, replay


def _connectable(endpoint: str) -> bool:
    """Whether ZMQ can connect a socket to ``endpoint``: ``tcp://host:port`` (a named
    host, not the ``*`` an engine binds) or ``ipc://path``."""
    scheme, sep, address = endpoint.partition("://")
    if not sep or not address:
        return False
    if scheme == "ipc":
        return True
    host, _, port = address.rpartition(":")
    return scheme == "tcp" and host not in ("", "*") and port.isdigit() and 0 < int(port) < 65536


class State:
    CONNECTED = "connected"
    SILENT = "silent"
    DISCONNECTED = "disconnected"
    OFF = "off"


@dataclass(slots=True)
class StreamCounters:
    received: int = 0  # events applied (every event of every batch)
    gaps: int = 0  # sequence gaps and publisher restarts seen
    replays: int = 0  # replay requests sent


class Subscriber:
    """Follows one instance's KV events into ``index``.

    Args:
        name: the instance (its URL), registered in ``index``.
        endpoint: vLLM's PUB endpoint (``tcp://host:port``).
        replay: vLLM's replay (ROUTER) endpoint, or None.
        index: the block index.
        on_stored: called with each ``BlockStored`` (block size, hash checks).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        name: str,
        endpoint: str,
        replay: str | None,
        index: BlockIndex,
        on_stored: Callable[[str, BlockStored], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.name = name
        self.endpoint = endpoint
        self.replay_endpoint = replay
        self.index = index
        self.on_stored = on_stored
        self.clock = clock
        self.counters = StreamCounters()
        self.connected = False
        self.last_seq: int | None = None
        self.last_event_at: float | None = None
        self._replayed_from: int | None = None  # live seqs from here up to last_seq are duplicates
        self._context = zmq.asyncio.Context.instance()
        self._task: asyncio.Task | None = None

    @property
    def state(self) -> str:
        return State.CONNECTED if self.connected else State.DISCONNECTED

    def last_event_age_s(self) -> float | None:
        if self.last_event_at is None:
            return None
        return self.clock() - self.last_event_at

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        watch = asyncio.get_running_loop().create_task(self._watch(monitor))
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    logger.warning(
                        "KV events of %s: a message of %d frames", self.name, len(frames)
                    )
                    continue
                _topic, seq_bytes, payload = frames
                await self.receive(int.from_bytes(seq_bytes, "big"), payload)
        finally:
            await cancel_and_wait(watch)
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            connected = event["event"] == zmq.EVENT_CONNECTED
            if connected != self.connected:
                logger.info(
                    "KV events of %s: %s %s",
                    self.name,
                    "connected to" if connected else "disconnected from",
                    self.endpoint,
                )
            if connected and not self.connected and self.last_seq is not None:
                # back after a disconnection: the engine may have restarted and lost what
                # it held, so its entries go; the next batch rebuilds them (a replay from 0)
                self.index.drop_instance(self.name)
                self.last_seq, self._replayed_from = None, None
            self.connected = connected

    # -- the sequence ----------------------------------------------------------------

    async def receive(self, seq: int, payload: bytes) -> None:
        """One live batch: check its sequence number (replay or drop on a gap), apply it."""
        last = self.last_seq
        if last is not None and seq == last + 1:
            self._apply(seq, payload)
            return
        if (
            last is not None
            and self._replayed_from is not None
            and self._replayed_from <= seq <= last
        ):
            return  # already applied from the replay
        self._replayed_from = None
        restarted = last is not None and seq <= last
        if last is not None:
            self.counters.gaps += 1
            logger.warning(
                "KV events of %s: %s (seq %d after %d)",
                self.name,
                "the publisher restarted" if restarted else "a gap",
                seq,
                last,
            )
        if restarted:
            self.index.drop_instance(self.name)
            self.last_seq = None  # the new publisher's batches are not duplicates
        start = 0 if last is None or restarted else last + 1
        recovered = False
        if self.replay_endpoint is not None and seq > start:
            recovered = await self._replay(start, seq)
        if not recovered and last is not None and not restarted:
            logger.warning("KV events of %s: dropping its index entries", self.name)
            self.index.drop_instance(self.name)
        if self.last_seq is None or seq > self.last_seq:
            self._apply(seq, payload)
        else:
            self._replayed_from = seq

    async def _replay(self, start: int, live_seq: int) -> bool:
        """Ask the replay endpoint for batches from ``start``; apply them. True when the
        batches from ``start`` up to ``live_seq`` all came."""
        self.counters.replays += 1
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        expected = start
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = self.clock() + REPLAY_TIMEOUT_S
            while True:
                left = deadline - self.clock()
                if left <= 0 or not await dealer.poll(left * 1000):
                    logger.warning(
                        "KV events of %s: no replay answer from %s", self.name, self.replay_endpoint
                    )
                    return False
                frames = await dealer.recv_multipart()
                if len(frames) != 4:
                    continue
                _, _topic, seq_bytes, payload = frames
                if seq_bytes == END_SEQ:
                    break
                seq = int.from_bytes(seq_bytes, "big")
                if seq != expected:
                    if seq > expected:
                        return False  # the publisher's buffer no longer has them
                    continue
                self._apply(seq, payload)
                expected = seq + 1
        finally:
            dealer.close(0)
        return expected >= live_seq

    # -- applying --------------------------------------------------------------------

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        self.last_event_at = self.clock()
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError as exc:
            logger.warning("KV events of %s: batch %d does not decode (%s)", self.name, seq, exc)
            return
        self.apply(batch)

    def apply(self, batch: KVEventBatch) -> None:
        """Apply a decoded batch's events to the index."""
        index, name = self.index, self.name
        for event in batch.events:
            if isinstance(event, BlockStored):
                index.stored(name, event.block_hashes, event.medium, event.locality)
                if self.on_stored is not None:
                    self.on_stored(name, event)
            elif isinstance(event, BlockRemoved):
                index.removed(name, event.block_hashes, event.medium, event.locality)
            else:
                index.cleared(name)
        self.counters.received += len(batch.events)
