"""``kvtier.routing``: the block index (stored / removed by medium / cleared, LRU, remote
groups), the scorer (longest consecutive prefix, weights, unusable instances), the block
hashes a router computes against vLLM's own ``hash_block_tokens`` chain, and the event
subscriber fed by vLLM's own ``ZmqEventPublisher`` on loopback (stored, removed, cleared,
a gap filled by replay, a gap without replay dropping the instance's entries, a
publisher restart).
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

pytest.importorskip("msgspec")
pytest.importorskip("zmq")

from support.kv_events_fake import free_port

from kvtier.routing.block_hashes import VLLM_HASH_ALGOS, RequestKeys, VllmBlockHasher
from kvtier.routing.events import Subscriber, parse_endpoint
from kvtier.routing.index import BlockIndex, block_key
from kvtier.routing.scoring import Scorer, Weights

pytestmark = pytest.mark.timeout(60)

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def index_of(
    *names: str, groups: dict[str, str] | None = None, max_blocks: int = 100
) -> BlockIndex:
    index = BlockIndex(max_blocks)
    for name in names:
        index.add_instance(name, (groups or {}).get(name, "decode"))
    return index


# -- the index ---------------------------------------------------------------------


def test_index_stored_removed_by_medium_and_cleared():
    index = index_of(A, B)
    index.stored(A, [1, 2, 3], "GPU", None)
    index.stored(A, [1, 2], "CPU", "LOCAL")
    index.stored(B, [1], "STORAGE", "LOCAL")
    assert len(index) == 3 and index.instances[A].blocks == 3 and index.instances[B].blocks == 1
    index.removed(A, [1, 2], "GPU", None)  # the CPU copies stay
    assert index.holders(1) == {0: 2, 1: 4} and index.holders(2) == {0: 2}
    index.removed(A, [3], "CPU", "LOCAL")  # not there: nothing happens
    assert index.holders(3) == {0: 1}
    index.stored(A, [3], "GPU", None)
    index.cleared(A)  # vLLM's AllBlocksCleared: its GPU entries only
    assert index.holders(3) is None and index.holders(2) == {0: 2}
    index.drop_instance(A)
    assert index.instances[A].blocks == 0 and len(index) == 1 and index.holders(1) == {1: 4}


def test_index_keys_fold_bytes_like_vllm_and_evict_least_recent():
    digest = bytes(range(32))
    assert block_key(digest) == int.from_bytes(digest, "big") & (2**64 - 1)
    assert block_key(digest) == block_key(block_key(digest))
    index = index_of(A, B, max_blocks=3)
    index.stored(A, [1, 2, 3], "GPU", None)
    index.holders(1)  # a lookup keeps 1 recent
    index.stored(B, [4], "GPU", None)
    assert index.holders(2) is None and index.evicted == 1
    assert index.instances[A].blocks == 2 and len(index) == 3


# -- scoring -----------------------------------------------------------------------


def test_scorer_takes_the_longest_consecutive_prefix_weighted_by_medium():
    index = index_of(A, B, C)
    index.stored(A, [1, 2], "GPU", None)
    index.stored(A, [4], "GPU", None)  # after a hole: does not count
    index.stored(B, [1, 2, 3], "CPU", "LOCAL")
    index.stored(C, [1], "STORAGE", "LOCAL")
    index.stored(C, [1], "GPU", None)  # the best place counts
    matches = Scorer(index, Weights()).matches([1, 2, 3, 4], [A, B, C], [A, B, C])
    assert [matches[n].blocks for n in (A, B, C)] == [2, 3, 1]
    assert matches[A].cache == pytest.approx(2 * 1.0 / 4)
    assert matches[B].cache == pytest.approx(3 * 0.8 / 4)
    assert matches[C].cache == pytest.approx(1.0 / 4)
    custom = Scorer(index, Weights(gpu=0.1, cpu=1.0)).matches([1, 2, 3, 4], [A, B], [A, B])
    assert custom[B].cache > custom[A].cache
    unusable = Scorer(index, Weights()).matches([1, 2], [A, B], [B])
    assert unusable[A].blocks == 0 and unusable[B].blocks == 2


def test_remote_blocks_count_for_every_instance_of_the_group():
    index = index_of(A, B, C, groups={C: "other"})
    index.stored(A, [1, 2], "STORAGE", "REMOTE")
    scorer = Scorer(index, Weights())
    matches = scorer.matches([1, 2, 3], [A, B, C], [A, B, C])
    assert [matches[n].blocks for n in (A, B, C)] == [2, 2, 0]
    assert matches[B].cache == pytest.approx(2 * 0.3 / 3)
    down_publisher = scorer.matches([1, 2], [A, B], [B])
    assert down_publisher[B].blocks == 2, "the shared tier holds them whoever announced them"


# -- block hashes against vLLM's --------------------------------------------------


@pytest.mark.parametrize("algo", VLLM_HASH_ALGOS)
@pytest.mark.parametrize(
    "keys",
    [RequestKeys(), RequestKeys(cache_salt="tenant-7"), RequestKeys("s", ("adapter", "/l/a"))],
    ids=["plain", "cache_salt", "salt+lora"],
)
def test_block_hashes_equal_vllms_hash_block_tokens_chain(algo, keys, monkeypatch):
    kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.utils.hashing import get_hash_fn_by_name

    hash_fn = get_hash_fn_by_name(algo)
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    monkeypatch.setattr(kv_cache_utils, "NONE_HASH", None, raising=False)
    monkeypatch.setattr(kv_cache_utils, "_NONE_HASH_SEED", None)
    kv_cache_utils.init_none_hash(hash_fn)
    tokens = random.Random(5).choices(range(150_000), k=16 * 5 + 7)
    extra = keys.extras(5)
    parent, expected = None, []
    for i in range(5):
        block_extra = extra[i] if extra is not None else None
        if keys.lora is not None:
            assert block_extra[0] == ("lora", *keys.lora)  # vLLM's _gen_lora_extra_hash_keys
        parent = kv_cache_utils.hash_block_tokens(
            hash_fn, parent, tokens[i * 16 : (i + 1) * 16], block_extra
        )
        expected.append(kv_cache_utils.maybe_convert_block_hash(parent))
    assert VllmBlockHasher(algo, "1234").block_keys(tokens, 16, keys) == expected
    assert VllmBlockHasher(algo, "4321").block_keys(tokens, 16, keys) != expected


def test_request_extra_keys_follow_vllms_generate_block_hash_extra_keys():
    kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from types import SimpleNamespace

    from vllm.lora.request import LoRARequest

    request = SimpleNamespace(
        mm_features=None,
        lora_request=LoRARequest("adapter", 1, "/l/a"),
        cache_salt="s",
        prompt_embeds=None,
    )
    expected = [
        kv_cache_utils.generate_block_hash_extra_keys(request, i * 16, (i + 1) * 16, 0)[0]
        for i in range(3)
    ]
    assert RequestKeys("s", ("adapter", "/l/a")).extras(3) == expected
    request.lora_request = None
    request.cache_salt = None
    assert kv_cache_utils.generate_block_hash_extra_keys(request, 0, 16, 0)[0] is None
    assert RequestKeys().extras(3) is None


# -- the subscriber, fed by vLLM's own publisher ----------------------------------


class Published:
    """vLLM's ``ZmqEventPublisher`` on loopback (PUB, optionally a replay ROUTER)."""

    def __init__(self, replay: bool):
        kv_events = pytest.importorskip("vllm.distributed.kv_events")
        self.kv = kv_events
        self.port, self.replay_port = free_port(), free_port()
        self.publisher = kv_events.ZmqEventPublisher(
            0,
            endpoint=f"tcp://*:{self.port}",
            replay_endpoint=f"tcp://*:{self.replay_port}" if replay else None,
        )
        self.spec = f"tcp://127.0.0.1:{self.port}"
        if replay:
            self.spec += f";replay=tcp://127.0.0.1:{self.replay_port}"

    def publish(self, *events) -> None:
        self.publisher.publish(self.kv.KVEventBatch(ts=time.time(), events=list(events)))

    def stored(self, hashes, medium="GPU", locality=None) -> None:
        self.publish(
            self.kv.BlockStored(
                block_hashes=hashes,
                parent_block_hash=None,
                token_ids=list(range(16 * len(hashes))),
                block_size=16,
                lora_id=None,
                medium=medium,
                lora_name=None,
                locality=locality,
            )
        )

    def close(self) -> None:
        self.publisher.shutdown()


async def until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def run_with_subscriber(replay: bool, body) -> None:
    published = Published(replay)
    index = index_of(A)
    stored_events = []

    async def main():
        pub, replay_endpoint = parse_endpoint(published.spec)
        subscriber = Subscriber(
            A, pub, replay_endpoint, index, lambda n, e: stored_events.append(e)
        )
        subscriber.start()
        try:
            await until(lambda: subscriber.connected)
            await asyncio.sleep(0.2)  # ZMQ's slow joiner: the subscription reaches the PUB
            await body(published, subscriber, index)
        finally:
            await subscriber.stop()

    try:
        asyncio.run(main())
    finally:
        published.close()
    assert stored_events, "on_stored saw the BlockStored events"


def test_subscriber_applies_stored_removed_and_cleared_from_vllms_publisher():
    async def body(published, subscriber, index):
        published.stored([11, 12, 13])
        published.stored([11, 12], medium="CPU", locality="LOCAL")
        await until(lambda: subscriber.last_seq == 1)
        assert index.holders(13) == {0: 1} and index.holders(11) == {0: 3}
        published.publish(
            published.kv.BlockRemoved(block_hashes=[11], medium="CPU", locality="LOCAL")
        )
        published.publish(published.kv.AllBlocksCleared())
        await until(lambda: subscriber.last_seq == 3)
        assert index.holders(11) is None and index.holders(12) == {0: 2}
        assert subscriber.counters.received == 4 and subscriber.counters.gaps == 0

    run_with_subscriber(False, body)


def test_a_gap_is_filled_by_replay():
    async def body(published, subscriber, index):
        published.stored([1])
        await until(lambda: subscriber.last_seq == 0)
        await subscriber.stop()  # batches 1 and 2 are missed
        published.stored([2])
        published.stored([3])
        await asyncio.sleep(0.3)
        subscriber.start()
        await until(lambda: subscriber.connected)
        await asyncio.sleep(0.2)
        published.stored([4])
        await until(lambda: subscriber.last_seq == 3)
        assert all(index.holders(k) == {0: 1} for k in (1, 2, 3, 4))
        assert subscriber.counters.gaps == 1 and subscriber.counters.replays == 1
        published.stored([5])
        await until(lambda: subscriber.last_seq == 4)
        assert subscriber.counters.gaps == 1

    run_with_subscriber(True, body)


def test_a_gap_without_replay_drops_the_instances_entries():
    async def body(published, subscriber, index):
        published.stored([1, 2])
        await until(lambda: subscriber.last_seq == 0)
        await subscriber.stop()
        published.stored([3])  # missed
        await asyncio.sleep(0.3)
        subscriber.start()
        await until(lambda: subscriber.connected)
        await asyncio.sleep(0.2)
        published.stored([4])
        await until(lambda: subscriber.last_seq == 2)
        assert index.holders(1) is None and index.holders(3) is None
        assert index.holders(4) == {0: 1} and index.instances[A].blocks == 1
        assert subscriber.counters.gaps == 1 and subscriber.counters.replays == 0

    run_with_subscriber(False, body)


def test_a_subscriber_started_late_asks_for_the_history_and_a_restart_drops_entries():
    async def body(published, subscriber, index):
        published.stored([1])
        await until(lambda: subscriber.last_seq == 0)
        subscriber.last_seq = 7  # as if a previous publisher had reached 7: seq 1 <= 7
        published.stored([2])
        await until(lambda: subscriber.last_seq == 1)
        assert subscriber.counters.gaps == 1
        assert index.holders(1) == {0: 1} and index.holders(2) == {0: 1}, "rebuilt by replay"

    run_with_subscriber(True, body)


def test_endpoint_specs():
    assert parse_endpoint("tcp://h:1") == ("tcp://h:1", None)
    assert parse_endpoint("tcp://h:1;replay=tcp://h:2") == ("tcp://h:1", "tcp://h:2")
    assert parse_endpoint("ipc:///tmp/events") == ("ipc:///tmp/events", None)
    for bad in ("h:1", "tcp://h:1;foo=1", "tcp://h:1;replay="):
        with pytest.raises(ValueError):
            parse_endpoint(bad)
    # what ZMQ cannot connect to is refused here, not by a subscriber that dies later
    for bad in ("tcp://h", "tcp://*:5557", "tcp://h:port", "tcp://h:0", "udp://h:1"):
        with pytest.raises(ValueError, match="not an endpoint to connect to"):
            parse_endpoint(bad)
    with pytest.raises(ValueError, match="'tcp://h'"):
        parse_endpoint("tcp://h:1;replay=tcp://h")


def test_a_restarted_publishers_later_batches_are_applied_without_a_replay():
    """After "the publisher restarted" (seq <= the last one seen) with no replay socket,
    the new publisher's next batches are live ones, not duplicates of a replay."""

    async def body(published, subscriber, index):
        published.stored([1])
        await until(lambda: subscriber.last_seq == 0)
        subscriber.last_seq = 7  # as if a previous publisher had reached 7
        published.stored([2])  # seq 1 <= 7: the publisher restarted
        await until(lambda: subscriber.counters.gaps == 1)
        published.stored([3])  # seq 2
        published.stored([4])  # seq 3
        await until(lambda: subscriber.last_seq == 3)
        assert index.holders(1) is None, "dropped with the restarted instance's entries"
        assert index.holders(3) == {0: 1} and index.holders(4) == {0: 1}

    run_with_subscriber(False, body)
