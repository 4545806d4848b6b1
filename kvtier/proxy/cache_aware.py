"""The proxy's ``cache_aware`` policy: tokenize a request, hash its blocks as vLLM does,
and pick the instance whose KV events show the longest weighted prefix (``kvtier.routing``).

Per request, on the pool picked by cache (decode alone; prefill in PD mode)::

    body ─▶ /tokenize on an instance of the pool (token ids cached per prompt)
         ─▶ block hashes (block size from the events; --hash-algo, --hash-seed;
            cache_salt; a LoRA's name and path from /v1/models)
         ─▶ each instance's match in the index ─▶ score ─▶ Pool.pick
              (timed: kvtier_proxy_route_seconds; the /tokenize round trip is not)

An instance holds nothing for scoring while its event stream is disconnected, or silent:
connected, but no batch came in the ``SILENT_AFTER_S`` since a request it answered, that
had blocks it did not hold, was scored (vLLM announces every block its prefix cache
computes, so such a request must bring an event, often before its answer ends). Its
entries stay; they count again when events flow.

Hash check: a ``BlockStored`` of a prompt's first block (no parent, no extra keys) is
hashed here too. With ``--hash-algo auto`` the first such event picks the algorithm;
otherwise, when none of the first ``HASH_CHECKS`` matches, one warning names the flags
(and the algorithm that would match).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvtier.proxy.instances import Instance, Pool, instance_address, normalize_url
from kvtier.proxy.prompts import TokenCache, are_token_ids, encodable, tokenize_body
from kvtier.routing.block_hashes import VLLM_HASH_ALGOS, RequestKeys, VllmBlockHasher
from kvtier.routing.events import BlockStored, State, Subscriber, parse_endpoint
from kvtier.routing.index import DEFAULT_MAX_BLOCKS, BlockIndex
from kvtier.routing.scoring import DEFAULT_LOAD_WEIGHT, Match, Scorer, Weights

logger = logging.getLogger("kvtier.proxy")

HASH_ALGO_CHOICES = ("auto", *VLLM_HASH_ALGOS)
SILENT_AFTER_S = 10.0
HASH_CHECKS = 16  # first-block events checked against the router's hashing
MODELS_REFRESH_S = 30.0
MATCHED_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
ROUTE_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2)


@dataclass(frozen=True, slots=True)
class RoutingSettings:
    """The ``cache_aware`` flags (``kvtier.commands.proxy``)."""

    kv_events: Mapping[str, str] = field(default_factory=dict)  # instance URL -> endpoint spec
    remote_groups: Mapping[str, str] = field(default_factory=dict)  # instance URL -> group
    index_blocks: int = DEFAULT_MAX_BLOCKS
    weights: Weights = field(default_factory=Weights)
    load_weight: float = DEFAULT_LOAD_WEIGHT
    hash_algo: str = "auto"
    hash_seed: str | None = None  # None: vLLM's default seed


@dataclass(slots=True)
class Decision:
    """What the scoring of one request found (no tokens: every match is empty)."""

    matches: dict[str, Match]
    tokens: int = 0
    blocks: int = 0
    block_size: int = 0
    routed: bool = False  # the first pick was made and counted in the metrics
    seconds: float = 0.0  # hashing and index walk; observed with the first pick's time
    scored_at: float = 0.0  # time.monotonic() of the scoring, before the request is sent

    def predicted_tokens(self, url: str) -> int:
        """The prompt tokens the engine should find cached on ``url``: its matched
        blocks, short of the last token (vLLM always computes at least one)."""
        match = self.matches.get(url)
        if match is None or not self.block_size or not self.tokens:
            return 0
        return min(match.blocks, (self.tokens - 1) // self.block_size) * self.block_size


@dataclass(slots=True)
class _Expecting:
    since: float  # a request with new blocks was scored then; an event should follow


def by_instance(flag: str, values: Mapping[str, str], urls: Iterable[str]) -> dict[str, str]:
    """``values`` keyed by the URL of the instance each of its URLs names, in any spelling
    that reaches it (``HTTP://Host:80/`` is ``http://host``; see `instance_address`).

    Raises:
        ValueError: naming ``flag``: a URL that is no instance, or one instance given twice.
    """
    instances = {instance_address(url): url for url in urls}
    keyed: dict[str, str] = {}
    for url, value in values.items():
        try:
            instance = instances.get(instance_address(normalize_url(url)))
        except ValueError as exc:
            raise ValueError(f"{flag} {url}: {exc}") from None
        if instance is None:
            raise ValueError(
                f"{flag} {url}: no --prefill or --decode instance has that URL "
                f"(instances: {', '.join(instances.values())})"
            )
        if instance in keyed:
            raise ValueError(f"{flag}: instance {instance} given twice")
        keyed[instance] = value
    return keyed


class CacheAwareRouter:
    """Subscribers, index, scorer and the per-request decision of ``cache_aware``.

    Args:
        settings: the routing flags.
        scored: the pool picked by cache.
        pools: every pool (for event subscriptions and remote groups).
        registry: the proxy's metrics registry (the routing series are added to it).

    Raises:
        ValueError: a ``--kv-events`` or ``--remote-group`` URL that is no instance, a
            bad endpoint, or no ``--kv-events`` at all.
    """

    def __init__(self, settings: RoutingSettings, scored: Pool, pools: list[Pool], registry):
        self.settings = settings
        self.scored = scored
        urls = {i.url: i for pool in pools for i in pool.instances}
        kv_events = by_instance("--kv-events", settings.kv_events, urls)
        remote_groups = by_instance("--remote-group", settings.remote_groups, urls)
        if not kv_events:
            raise ValueError(
                "--policy cache_aware needs the instances' KV events: "
                "--kv-events INSTANCE_URL=tcp://host:port (repeat per instance)"
            )
        if settings.hash_algo not in HASH_ALGO_CHOICES:
            raise ValueError(
                f"--hash-algo {settings.hash_algo!r}: allowed are {', '.join(HASH_ALGO_CHOICES)}"
            )
        self.index = BlockIndex(settings.index_blocks)
        for url, instance in urls.items():
            self.index.add_instance(url, remote_groups.get(url, instance.role))
        self.scorer = Scorer(self.index, settings.weights)
        seed = settings.hash_seed if settings.hash_seed is not None else "vllm-none-hash"
        algo = "sha256" if settings.hash_algo == "auto" else settings.hash_algo
        self.hasher = VllmBlockHasher(algo, seed)
        self._algo_known = settings.hash_algo != "auto"
        self._hash_checks = self._hash_matches = 0
        self.block_size: int | None = None
        self.subscribers: dict[str, Subscriber] = {}
        for url, spec in kv_events.items():
            try:
                pub, replay = parse_endpoint(spec)
            except ValueError as exc:
                raise ValueError(f"--kv-events {url}: {exc}") from None
            self.subscribers[url] = Subscriber(url, pub, replay, self.index, self._on_stored)
        self.tokens = TokenCache()
        self.lora_paths: dict[str, str] = {}
        self._models_fetched_at = -MODELS_REFRESH_S
        self._known_models: set[str] = set()
        self._expecting: dict[str, _Expecting] = {}
        self._tokenize_next = 0
        self.decisions = Counter(
            "kvtier_proxy_route_decisions",
            "Instances chosen by the cache_aware policy.",
            ["instance", "role"],
            registry=registry,
        )
        self.matched_blocks = Histogram(
            "kvtier_proxy_route_matched_blocks",
            "Blocks of the request's prefix the chosen instance holds (predicted), per decision.",
            buckets=MATCHED_BUCKETS,
            registry=registry,
        )
        self.route_seconds = Histogram(
            "kvtier_proxy_route_seconds",
            "Seconds of one cache_aware decision: hashing, index and pick (no /tokenize).",
            buckets=ROUTE_BUCKETS,
            registry=registry,
        )
        self.predicted_cached = Counter(
            "kvtier_proxy_predicted_cached_tokens",
            "Prompt tokens the chosen instances were predicted to have cached.",
            registry=registry,
        )
        self.actual_cached = Counter(
            "kvtier_proxy_actual_cached_tokens",
            "Prompt tokens the engines reported cached (usage.prompt_tokens_details).",
            registry=registry,
        )
        registry.register(_StreamCollector(self))

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        for subscriber in self.subscribers.values():
            subscriber.start()

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.subscribers.values()))

    # -- events ----------------------------------------------------------------------

    def _on_stored(self, url: str, event: BlockStored) -> None:
        size = event.block_size
        if size and self.block_size is None:
            self.block_size = size
            logger.info("cache_aware: block size %d (from %s's events)", size, url)
        elif size and size != self.block_size:
            logger.warning(
                "cache_aware: %s announces block size %d, not %d", url, size, self.block_size
            )
        if self._hash_matches >= HASH_CHECKS or event.parent_block_hash is not None:
            return
        if event.lora_name is not None or any(k is not None for k in event.extra_keys or ()):
            return
        if not size or len(event.token_ids) < size or not event.block_hashes:
            return
        self._check_hash(url, event.block_hashes[0], event.token_ids[:size])

    def _check_hash(self, url: str, block_hash: int | bytes, tokens: list[int]) -> None:
        if self.hasher.first_block_matches(block_hash, tokens):
            self._hash_matches += 1
            self._algo_known = True
            return
        seed = self.hasher.seed
        fits = [
            a
            for a in VLLM_HASH_ALGOS
            if VllmBlockHasher(a, seed).first_block_matches(block_hash, tokens)
        ]
        if not self._algo_known and fits:
            self.hasher = VllmBlockHasher(fits[0], seed)
            self._algo_known = True
            self._hash_matches += 1
            logger.info("cache_aware: the engines hash blocks with %s (--hash-algo auto)", fits[0])
            return
        self._hash_checks += 1
        if self._hash_checks == HASH_CHECKS and not self._hash_matches:
            hint = (
                f"the engines use --prefix-caching-hash-algo {fits[0]}: pass --hash-algo {fits[0]}"
                if fits
                else "set --hash-seed to the engines' PYTHONHASHSEED (with xxhash and no "
                "PYTHONHASHSEED every engine draws a random seed: set one)"
            )
            logger.warning(
                "cache_aware: none of %d block hashes in %s's events matches --hash-algo %s "
                "--hash-seed %r, so no request can match the cache; %s",
                HASH_CHECKS,
                url,
                self.hasher.algo,
                seed,
                hint,
            )

    # -- stream state ----------------------------------------------------------------

    def stream_state(self, url: str) -> str:
        subscriber = self.subscribers.get(url)
        if subscriber is None:
            return State.OFF
        if not subscriber.connected:
            return State.DISCONNECTED
        expecting = self._expecting.get(url)
        if expecting is not None:
            last = subscriber.last_event_at
            if last is not None and last > expecting.since:
                del self._expecting[url]
            elif time.monotonic() - expecting.since > SILENT_AFTER_S:
                return State.SILENT
        return State.CONNECTED

    def stream_json(self, url: str) -> dict[str, object]:
        subscriber = self.subscribers.get(url)
        age = subscriber.last_event_age_s() if subscriber is not None else None
        return {
            "endpoint": subscriber.endpoint if subscriber is not None else None,
            "state": self.stream_state(url),
            "last_seq": subscriber.last_seq if subscriber is not None else None,
            "last_event_age_s": None if age is None else round(age, 3),
            "blocks": self.index.instances[url].blocks,
        }

    def answered(
        self, pool: Pool, instance: Instance, decision: Decision, cached: int | None
    ) -> None:
        """``instance`` answered a request scored by ``decision`` (without an error).
        From the pool picked by cache: count the cached tokens the answer reports, and
        if the request had blocks the instance did not hold, an event must follow
        (silence detection)."""
        if pool is not self.scored:
            return
        if cached is not None:
            self.actual_cached.inc(cached)
        match = decision.matches.get(instance.url)
        if (
            instance.url in self.subscribers
            and match is not None
            and match.blocks < decision.blocks
        ):
            # NOTE: since the scoring, not the answer: vLLM publishes a step's events as
            # the step ends, so the request's event comes before its answer ends
            self._expecting.setdefault(instance.url, _Expecting(decision.scored_at))

    # -- decisions -------------------------------------------------------------------

    async def decide(
        self,
        session: aiohttp.ClientSession,
        path: str,
        body: dict,
        headers: dict[str, str],
        timeout,
    ) -> Decision:
        """Score every instance of the scored pool for ``body`` (a request to ``path``)."""
        tokens = await self._tokens(session, path, body, headers, timeout)
        return self.decision(tokens, body)

    def decision(self, tokens, body: dict) -> Decision:
        """The scoring of a request with token ids ``tokens`` (None: unknown)."""
        scored_at = time.monotonic()
        started = time.perf_counter()
        names = [i.url for i in self.scored.instances]
        block_size = self.block_size
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        if tokens is None or not block_size or not encodable(salt or ""):
            decision = Decision({n: Match() for n in names})
        else:
            model = body.get("model")
            known = isinstance(model, str) and model in self.lora_paths
            lora = (model, self.lora_paths[model]) if known else None
            keys = self.hasher.block_keys(tokens, block_size, RequestKeys(salt, lora))
            usable = [n for n in names if self.stream_state(n) == State.CONNECTED]
            matches = self.scorer.matches(keys, names, usable)
            decision = Decision(matches, len(tokens), len(keys), block_size)
        decision.seconds = time.perf_counter() - started
        decision.scored_at = scored_at
        return decision

    def pick(self, pool: Pool, decision: Decision, exclude: list[Instance]) -> Instance | None:
        """``pool``'s pick: by ``decision`` for the pool picked by cache (metrics on the
        first pick), by load for the other."""
        if pool is not self.scored:
            return pool.pick(exclude=exclude)
        started = time.perf_counter()
        load_weight = self.settings.load_weight
        matches = decision.matches

        def score(instance: Instance) -> float:
            match = matches.get(instance.url)
            return (match.cache if match is not None else 0.0) - load_weight * instance.in_flight

        chosen = self.scored.pick(exclude=exclude, score=score)
        if chosen is not None:
            self.decisions.labels(chosen.url, chosen.role).inc()
        if not decision.routed:  # one observation per request, not per retry
            decision.routed = True
            if chosen is not None:
                self.matched_blocks.observe((matches.get(chosen.url) or Match()).blocks)
                self.predicted_cached.inc(decision.predicted_tokens(chosen.url))
            self.route_seconds.observe(decision.seconds + time.perf_counter() - started)
        return chosen

    # -- token ids -------------------------------------------------------------------

    async def _tokens(self, session, path: str, body: dict, headers: dict[str, str], timeout):
        request = tokenize_body(path, body)
        if request is None or isinstance(request, list):
            return request
        key = TokenCache.key(request)
        cached = self.tokens.get(key)
        if cached is not None:
            return cached
        instance = self._tokenizer_instance()
        if instance is None:
            return None
        await self._learn_models(session, instance, request.get("model"), headers, timeout)
        try:
            async with session.post(
                instance.url + "/tokenize", json=request, headers=headers, timeout=timeout
            ) as response:
                if response.status != 200:
                    logger.debug("/tokenize on %s answered %d", instance.url, response.status)
                    return None
                answer = await response.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            logger.debug("/tokenize on %s failed: %r", instance.url, exc)
            return None
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list) or not are_token_ids(tokens):
            return None
        return self.tokens.put(key, tokens)

    def _tokenizer_instance(self) -> Instance | None:
        """An instance of the scored pool that is up, in turn."""
        up = [i for i in self.scored.instances if not i.is_down]
        if not up:
            return None
        self._tokenize_next += 1
        return up[self._tokenize_next % len(up)]

    async def _learn_models(self, session, instance: Instance, model, headers, timeout) -> None:
        """LoRA adapters' paths (their block hashes carry them) from ``/v1/models``: at the
        first request, then when a model name not seen before comes, at most every
        ``MODELS_REFRESH_S``."""
        if not isinstance(model, str) or model in self._known_models:
            return
        now = time.monotonic()
        if now - self._models_fetched_at < MODELS_REFRESH_S:
            return
        self._models_fetched_at = now
        get_headers = {k: v for k, v in headers.items() if k != "Content-Type"}
        try:
            async with session.get(
                instance.url + "/v1/models", headers=get_headers, timeout=timeout
            ) as response:
                listing = await response.json() if response.status == 200 else {}
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return
        for card in listing.get("data") or () if isinstance(listing, dict) else ():
            if not isinstance(card, dict) or not isinstance(card.get("id"), str):
                continue
            self._known_models.add(card["id"])
            if card.get("parent") and isinstance(card.get("root"), str):
                self.lora_paths[card["id"]] = card["root"]


class _StreamCollector:
    """The per-stream series and the index size, read at scrape time."""

    def __init__(self, router: CacheAwareRouter):
        self._router = router

    def describe(self) -> list:
        return []

    def collect(self):
        router = self._router
        families = {
            "received": CounterMetricFamily(
                "kvtier_proxy_kv_events_received",
                "KV events applied, per instance.",
                labels=["instance"],
            ),
            "gaps": CounterMetricFamily(
                "kvtier_proxy_kv_events_gaps",
                "Sequence gaps (and publisher restarts) in an instance's KV events.",
                labels=["instance"],
            ),
            "replays": CounterMetricFamily(
                "kvtier_proxy_kv_events_replays",
                "Replay requests sent to an instance.",
                labels=["instance"],
            ),
        }
        for url, subscriber in router.subscribers.items():
            for name, family in families.items():
                family.add_metric([url], getattr(subscriber.counters, name))
        yield from families.values()
        blocks = GaugeMetricFamily(
            "kvtier_proxy_index_blocks", "Block hashes in the routing index."
        )
        blocks.add_metric([], len(router.index))
        yield blocks
