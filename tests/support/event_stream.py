"""A subscriber to a vLLM engine's ZMQ KV event stream, decoded with vLLM's own classes
(``vllm.distributed.kv_events.KVEventBatch``, msgspec), as a router built on vLLM reads it.

    stream = EventStream("tcp://127.0.0.1:PORT")   # before or after the publisher binds
    ...                                            # requests to the engine
    events = stream.take()        # every event so far, once the stream has gone quiet
    stream.close()

A thread receives each multipart message ``[topic, seq (8 bytes, big-endian), payload]``
and keeps its events in order; ``seqs`` holds the sequence numbers seen.
"""

from __future__ import annotations

import threading
import time


class EventStream:
    """A SUB socket on ``endpoint``; a thread collects every batch's events."""

    def __init__(self, endpoint: str):
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._lock = threading.Lock()
        self.events: list = []
        self.seqs: list[int] = []
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-sub", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(50):
                _topic, seq, payload = self._socket.recv_multipart()
                batch = self._decoder.decode(payload)
                with self._lock:
                    self.events.extend(batch.events)
                    self.seqs.append(int.from_bytes(seq, "big", signed=True))
                    self._last = time.monotonic()

    def take(self, quiet: float = 1.0) -> list:
        """Everything received so far, once nothing arrived for ``quiet`` seconds (since
        the call at least: an engine publishes a step's events after it answered)."""
        called = time.monotonic()
        while time.monotonic() - max(self._last, called) < quiet:
            time.sleep(0.05)
        with self._lock:
            taken, self.events = self.events, []
        return taken

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
        self._context.term()
