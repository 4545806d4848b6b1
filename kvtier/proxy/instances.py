"""The engine instances behind the proxy, their up/down state and how one is picked.

An ``Instance`` is one OpenAI-compatible server (a vLLM engine) with a role, prefill or
decode. A ``Pool`` holds the instances of one role and picks one per request:

    round_robin    the next instance in turn among those up
    least_loaded   the instance with the fewest requests in flight through this proxy
                   (ties: the one picked least recently)
    cache_aware    the highest score the caller gives (``cache_aware.py``: the cached
                   prefix against the load); ties and no score: least_loaded

NOTE: an instance that fails (connection error, timeout, 5xx) is marked down for
``retry_after_s``. A down instance is skipped until that delay has passed; then it is
eligible again, so the next request that picks it re-tries it (and the proxy's health
probe, which GETs ``/health`` of the down instances, may bring it back sooner). A
success marks it up. Nothing here does I/O: the clock is passed in, so selection and
state are tested without a network.
"""

from __future__ import annotations

import ipaddress
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

POLICIES = ("round_robin", "least_loaded", "cache_aware")


@dataclass(slots=True)
class Instance:
    """One engine: its base URL (``http://host:port``, no trailing slash), its role, and
    what the proxy has seen of it."""

    url: str
    role: str  # "prefill" or "decode"
    in_flight: int = 0
    requests: int = 0  # requests sent to it (both outcomes)
    failures: int = 0  # connection errors, timeouts and 5xx answers
    down_until: float = 0.0  # monotonic time before which it is skipped; 0: up
    last_error: str = ""
    last_picked: int = 0  # pick counter value when last picked (least_loaded's tie-break)

    @property
    def is_down(self) -> bool:
        """Marked down and not yet recovered (its retry delay may have passed)."""
        return self.down_until > 0.0

    def eligible(self, now: float) -> bool:
        """Up, or down with its retry delay over (the next pick re-tries it)."""
        return self.down_until <= now

    def as_json(self, now: float) -> dict[str, object]:
        row: dict[str, object] = {
            "url": self.url,
            "up": not self.is_down,
            "in_flight": self.in_flight,
            "requests": self.requests,
            "failures": self.failures,
        }
        if self.is_down:
            row["retry_in_s"] = round(max(0.0, self.down_until - now), 3)
            row["last_error"] = self.last_error
        return row


@dataclass(slots=True)
class Pool:
    """The instances of one role and the policy that picks among them.

    Args:
        role: "prefill" or "decode" (labels in logs and metrics).
        urls: base URLs, in the order given on the command line.
        policy: one of ``POLICIES``.
        retry_after_s: how long a failed instance is skipped.
        clock: monotonic seconds (``time.monotonic``; tests pass their own).

    Raises:
        ValueError: an unknown policy, a negative delay or two equal URLs.
    """

    role: str
    urls: Sequence[str]
    policy: str = "round_robin"
    retry_after_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    instances: list[Instance] = field(init=False)
    _next: int = field(init=False, default=0)  # round_robin: where the next search starts
    _picks: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r}: allowed are {', '.join(POLICIES)}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        urls = [normalize_url(url) for url in self.urls]
        if len({instance_address(url) for url in urls}) != len(urls):
            raise ValueError(f"{self.role} instances given twice: {urls}")
        self.instances = [Instance(url, self.role) for url in urls]

    def __len__(self) -> int:
        return len(self.instances)

    def pick(
        self,
        exclude: Sequence[Instance] = (),
        score: Callable[[Instance], float] | None = None,
    ) -> Instance | None:
        """The instance for the next request, or None when every instance not in
        ``exclude`` is down (within its retry delay). ``score``: the cache_aware
        policy's score of each instance (higher wins)."""
        now = self.clock()
        candidates = [i for i in self.instances if i.eligible(now) and i not in exclude]
        if not candidates:
            return None
        self._picks += 1
        if self.policy == "cache_aware" and score is not None:
            chosen = max(candidates, key=lambda i: (score(i), -i.in_flight, -i.last_picked))
        elif self.policy != "round_robin":
            chosen = min(candidates, key=lambda i: (i.in_flight, i.last_picked))
        else:
            # The first candidate after the last one picked, so the rotation stays even
            # among the instances up when some are skipped.
            order = self.instances[self._next :] + self.instances[: self._next]
            chosen = next(i for i in order if i in candidates)
            self._next = (self.instances.index(chosen) + 1) % len(self.instances)
        chosen.last_picked = self._picks
        return chosen

    @contextmanager
    def in_flight(self, instance: Instance) -> Iterator[Instance]:
        """Count a request in flight on ``instance`` for the duration of the block."""
        instance.in_flight += 1
        instance.requests += 1
        try:
            yield instance
        finally:
            instance.in_flight -= 1

    def mark_down(self, instance: Instance, error: str, *, count: bool = True) -> None:
        """A failure: skip the instance for ``retry_after_s``; ``count``: a failed request
        (False for a failed health probe of an instance already down)."""
        instance.failures += count
        instance.last_error = error
        # A delay of 0 still needs a nonzero mark for ``is_down``.
        instance.down_until = max(self.clock() + self.retry_after_s, 1e-9)

    def mark_up(self, instance: Instance) -> None:
        instance.down_until = 0.0
        instance.last_error = ""

    def down(self) -> list[Instance]:
        return [i for i in self.instances if i.is_down]

    def next_retry_s(self) -> float:
        """Seconds until an instance may be tried again: 0 when one is up or due."""
        now = self.clock()
        return min((max(0.0, i.down_until - now) for i in self.instances), default=0.0)

    def up_count(self) -> int:
        return sum(not i.is_down for i in self.instances)

    def as_json(self) -> list[dict[str, object]]:
        now = self.clock()
        return [i.as_json(now) for i in self.instances]


def check_roles(prefill: Pool, decode: Pool) -> None:
    """Refuse an instance given in both roles: the proxy would send it each request twice
    (a one-token prefill, then the decode) and count its failures and load twice. Two URLs
    are one instance when their ``instance_address`` is the same.

    Raises:
        ValueError: an instance in both pools, naming the flags. An engine that prefills
            and decodes is a decode instance alone (no prefill pool).
    """
    decode_addresses = {instance_address(i.url): i.url for i in decode.instances}
    both = sorted(
        i.url if i.url == decode_addresses[address] else f"{i.url} (= {decode_addresses[address]})"
        for i in prefill.instances
        if (address := instance_address(i.url)) in decode_addresses
    )
    if both:
        raise ValueError(
            f"{', '.join(both)} given both as --prefill and as --decode: an instance has one "
            "role (an engine that prefills and decodes is given as --decode alone)"
        )


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` → ``http://host:port``.

    Raises:
        ValueError: an empty URL, a scheme other than http/https, a user or password
            (never shown back), no host, a space in the address, a port that is not a
            number, or a path, query or fragment (the proxy appends ``/v1/completions``,
            ``/health``, ... to the server's address).
    """
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("an instance URL is empty")
    if "://" not in url:
        url = f"http://{url}"
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()  # HTTP://host is http://host
    if scheme not in ("http", "https"):
        raise ValueError(f"instance URL {url!r}: the scheme must be http or https")
    url = f"{scheme}://{rest}"
    parts = urllib.parse.urlsplit(url)
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            "an instance URL carries a user or password: the proxy shows its instances' "
            "URLs in /health and in metric labels; give http://host:port alone"
        )
    if any(c.isspace() for c in parts.netloc):
        raise ValueError(f"instance URL {url!r}: the address holds a space")
    try:
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError:
        raise ValueError(f"instance URL {url!r}: the port must be a number 0..65535") from None
    if not parts.hostname:
        raise ValueError(f"instance URL {url!r}: no host")
    if parts.port == 0:
        raise ValueError(
            f"instance URL {url!r}: port 0 is no server's port; give the port it listens on"
        )
    if parts.path or parts.query or parts.fragment:
        raise ValueError(
            f"instance URL {url!r}: give the server's address alone, http://host:port "
            "(the proxy adds /v1/completions, /health, ...)"
        )
    return url


# Hosts that reach this machine's own servers: an engine started with vLLM's default
# ``--host`` (every address) answers on all of them.
THIS_MACHINE = ("localhost", "127.0.0.1", "::1", "0.0.0.0", "::")


def instance_address(url: str) -> tuple[str, str, int]:
    """What a normalized URL connects to: (scheme, host, port), to tell whether two URLs
    are one instance. The port is the scheme's (80, 443) when none is given; an IP
    address is in one spelling (``[0:0::1]`` is ``::1``, ``::ffff:10.0.0.1`` is
    ``10.0.0.1``); ``localhost``, ``127.0.0.1``, ``[::1]``, ``0.0.0.0`` and ``[::]`` are one
    host, this machine.

    NOTE: host names are not resolved (the proxy starts without waiting on DNS): a name
    and its address (``gpu1`` and ``10.0.0.1``) count as two hosts.
    """
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""  # lower case, without an IPv6 address's brackets
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        mapped = getattr(ip, "ipv4_mapped", None)
        host = (mapped or ip).compressed
    if host in THIS_MACHINE:
        host = "localhost"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, host, port
