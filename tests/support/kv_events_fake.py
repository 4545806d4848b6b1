"""A fake engine's KV event stream: vLLM's wire format (``[topic, seq, msgpack
KVEventBatch]`` on a ZMQ PUB socket) from kvtier's own mirror classes, so the proxy's
tests need no vLLM. ``publish`` sends one batch; ``skip`` loses sequence numbers (a gap).
"""

from __future__ import annotations

import socket
import time

import msgspec
import zmq

from kvtier.routing.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeKVEvents:
    """A PUB socket bound on loopback; ``endpoint`` is what ``--kv-events`` names."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.endpoint)
        self._encode = msgspec.msgpack.Encoder().encode
        self.seq = 0

    def publish(self, *events) -> None:
        batch = KVEventBatch(ts=time.time(), events=list(events))
        self._socket.send_multipart([b"", self.seq.to_bytes(8, "big"), self._encode(batch)])
        self.seq += 1

    def stored(self, hashes, medium="GPU", locality=None, block_size=4, tokens=None) -> None:
        ownership = None if medium == "GPU" else "kvtier"
        self.publish(
            BlockStored(
                block_hashes=list(hashes),
                parent_block_hash=None,
                token_ids=list(tokens or []),
                block_size=block_size,
                medium=medium,
                locality=locality,
                ownership=ownership,
            )
        )

    def removed(self, hashes, medium="GPU", locality=None) -> None:
        self.publish(BlockRemoved(block_hashes=list(hashes), medium=medium, locality=locality))

    def cleared(self) -> None:
        self.publish(AllBlocksCleared())

    def skip(self, count: int = 1) -> None:
        self.seq += count

    def close(self) -> None:
        self._socket.close(0)
