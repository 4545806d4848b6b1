"""The cost of one ``cache_aware`` decision in the proxy, against ``round_robin``'s pick.

What is timed is what ``kvtier_proxy_route_seconds`` times: the request's block hashes
(its token ids already known: the ``/tokenize`` round trip is not included, it is the
engine's time), the index walk over every instance, and the pool's scored pick. The
baseline is ``Pool.pick`` under ``round_robin`` in the same run.

Setup: 4 decode instances; an index of 200,000 blocks (LRU budget 1,000,000) filled by
events of 16-token blocks; a 2,048-token prompt (128 blocks) whose first 96 blocks one
instance holds on the GPU and another in its CPU tier. Rows for vLLM's default
``sha256`` (pickle) and ``sha256_cbor`` (kvtier's vectorised hashing).
"""

from __future__ import annotations

import random
import statistics
import time

import pytest

pytest.importorskip("msgspec")
pytest.importorskip("zmq")

from prometheus_client import CollectorRegistry

from kvtier.proxy.cache_aware import CacheAwareRouter, RoutingSettings
from kvtier.proxy.instances import Pool
from kvtier.routing.block_hashes import RequestKeys

RESULTS_NAME = "proxy"
BLOCK = 16
PROMPT_TOKENS = 2048
INDEX_BLOCKS = 200_000
ROUNDS = 2000
INSTANCES = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]


def _router(algo: str) -> tuple[CacheAwareRouter, Pool, list[int]]:
    pool = Pool("decode", INSTANCES, "cache_aware")
    settings = RoutingSettings(
        kv_events={u: "tcp://127.0.0.1:1" for u in INSTANCES}, hash_algo=algo
    )
    router = CacheAwareRouter(settings, pool, [pool], CollectorRegistry())
    router.block_size = BLOCK
    rng = random.Random(0)
    for n in range(INDEX_BLOCKS // 1000):
        url = INSTANCES[n % len(INSTANCES)]
        router.index.stored(url, [rng.getrandbits(64) for _ in range(1000)], "GPU", None)
    tokens = rng.choices(range(128_000), k=PROMPT_TOKENS)
    keys = router.hasher.block_keys(tokens, BLOCK, RequestKeys())
    router.index.stored(INSTANCES[0], keys[:96], "GPU", None)
    router.index.stored(INSTANCES[1], keys[:96], "CPU", "LOCAL")
    for subscriber in router.subscribers.values():
        subscriber.connected = True  # as if the streams were up (nothing is started)
    return router, pool, tokens


def _median_us(fn) -> float:
    for _ in range(50):
        fn()
    times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_cache_aware_decision_cost(benchmark, record, algo):
    router, pool, tokens = _router(algo)
    body = {"model": "m", "prompt": "..."}
    baseline_pool = Pool("decode", INSTANCES, "round_robin")

    def decide():
        decision = router.decision(tokens, body)
        chosen = router.pick(pool, decision, [])
        assert chosen.url == INSTANCES[0]

    def hash_only():
        router.hasher.block_keys(tokens, BLOCK, RequestKeys())

    benchmark.pedantic(decide, rounds=200, warmup_rounds=20)
    decide_us = _median_us(decide)
    hash_us = _median_us(hash_only)
    round_robin_us = _median_us(baseline_pool.pick)
    record(
        metric=f"cache_aware_decision_{algo}_us",
        value=decide_us,
        unit="us",
        baseline="round_robin Pool.pick (same run)",
        baseline_value=round_robin_us,
        hashing_us=hash_us,
        prompt_tokens=PROMPT_TOKENS,
        block_size=BLOCK,
        index_blocks=len(router.index),
        instances=len(INSTANCES),
    )
    benchmark.extra_info["decision_us"] = decide_us
    print(
        f"\ncache_aware decision ({algo}, {PROMPT_TOKENS} tokens): {decide_us:.1f} us "
        f"(hashing {hash_us:.1f} us) vs round_robin pick {round_robin_us:.2f} us"
    )
