"""Scoring: the longest consecutive prefix of a request's blocks each instance holds,
weighted by where it holds them, against the instance's load.

    cache(i) = sum over the blocks b_0, b_1, ... that i holds, stopping at the first it
               does not, of weight(best place i can load b_k from) / blocks in the request
    score(i) = cache(i) - load_weight * requests in flight on i

Places and their default weights (flags ``--weight-*``): GPU (vLLM's prefix cache) 1.0,
CPU (kvtier's CPU tier) 0.8, local storage (its disk tier) 0.5, remote (a tier every
instance of the remote group loads from) 0.3. A REMOTE block counts for every instance in
the group of the instance that announced it.

Why ``cache`` is a share of the request: a full hit is worth 1.0 whatever the prompt's
length, so ``load_weight`` reads as "one request in flight costs this share of a
prompt". The default 0.1: a request whose whole prefix sits in one instance's GPU cache
stays there until that instance has ten more requests in flight than another; a
remote-only hit (0.3, the same on every instance of the group) is outweighed by three,
so with a shared remote tier the load decides sooner.

Instances the caller marks unusable (HTTP down, event stream disconnected or silent)
hold nothing. Ties and empty matches are the pool's least-loaded choice.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvtier.routing.index import CLASS_BITS, REMOTE_BIT, BlockIndex

DEFAULT_LOAD_WEIGHT = 0.1


@dataclass(frozen=True, slots=True)
class Weights:
    """What a block is worth by where the instance can load it from."""

    gpu: float = 1.0
    cpu: float = 0.8
    local_storage: float = 0.5
    remote: float = 0.3

    def __post_init__(self) -> None:
        for name in ("gpu", "cpu", "local_storage", "remote"):
            if getattr(self, name) < 0:
                raise ValueError(f"--weight-{name.replace('_', '-')} must be >= 0")

    def local_table(self) -> list[float]:
        """The weight of every combination of local placement bits (max over them)."""
        by_class = (self.gpu, self.cpu, self.local_storage)
        table = []
        for bits in range(8):
            held = [w for w, bit in zip(by_class, CLASS_BITS[:3], strict=True) if bits & bit]
            table.append(max(held, default=0.0))
        return table


@dataclass(slots=True)
class Match:
    """One instance's match: consecutive blocks held from the start, and their weighted
    share of the request's blocks."""

    blocks: int = 0
    cache: float = 0.0


class Scorer:
    """Scores instances on a ``BlockIndex``.

    Args:
        index: the block index the events fill.
        weights: per-place weights.
    """

    def __init__(self, index: BlockIndex, weights: Weights):
        self.index = index
        self.weights = weights
        self._local = weights.local_table()

    def matches(
        self, keys: Sequence[int], names: Collection[str], usable: Collection[str]
    ) -> dict[str, Match]:
        """The match of each instance in ``names`` (instance names as the index knows
        them) for a request with block keys ``keys``; an instance not in ``usable``
        holds nothing (its match is empty, and its remote announcements still count for
        its group)."""
        index = self.index
        entries = {n: index.instances[n] for n in names if n in index.instances}
        out = {name: Match() for name in names}
        if not keys:
            return out
        alive = {e.number: e for name, e in entries.items() if name in usable}
        local, remote_w = self._local, self.weights.remote
        total = float(len(keys))
        for key in keys:
            if not alive:
                break
            holders = index.holders(key)
            if holders is None:
                break
            groups = {
                index.entry(number).remote_group
                for number, bits in holders.items()
                if bits & REMOTE_BIT
            }
            for number, entry in list(alive.items()):
                weight = local[holders.get(number, 0) & 7]
                if entry.remote_group in groups:
                    weight = max(weight, remote_w)
                if weight <= 0.0:
                    del alive[number]
                    continue
                match = out[entry.name]
                match.blocks += 1
                match.cache += weight / total
        return out
