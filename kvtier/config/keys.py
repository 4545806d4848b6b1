"""Config keys: what one key is (``KeySpec``), how groups of keys make the fields of a
config dataclass (``key_registry``, ``key_fields``), and how a raw value becomes a valid
one (``coerce``).

Each concern declares its keys as tuples of ``KeySpec`` (``engine``, ``tiers``,
``remote``, ``connector``, ``blend``); ``kvtier.config`` composes them into the registry
``CONFIG_KEYS`` and the fields of ``KVTierConfig``.

Values come typed from YAML files and mappings (checked strictly) or as text from
environment variables (parsed to the key's type first). Problems are collected, not
raised: :func:`coerce` appends one line per problem naming the key, the value, where it
came from and what is allowed, so a config with several problems reports them all at
once in one :class:`ConfigError`.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "KVTIER_"

_ENV_TRUE = frozenset({"true", "1", "yes", "on"})
_ENV_FALSE = frozenset({"false", "0", "no", "off"})
_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


class ConfigError(ValueError):
    """The configuration is invalid; ``problems`` lists every problem found.

    Each problem names the key (or environment variable, or file), the offending value,
    where it came from and what is allowed.
    """

    def __init__(self, problems: str | Sequence[str]) -> None:
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = f"invalid kvtier configuration: {self.problems[0]}"
        else:
            listed = "".join(f"\n  - {p}" for p in self.problems)
            message = f"invalid kvtier configuration ({len(self.problems)} problems):{listed}"
        super().__init__(message)

    def __reduce__(self) -> tuple[type[ConfigError], tuple[list[str]]]:
        return (type(self), (self.problems,))


@dataclass(frozen=True, slots=True)
class KeySpec:
    """Everything kvtier knows about one config key.

    ``name`` is the key and the config's attribute; ``kind`` is one of bool, int, float,
    str. ``choices`` (str keys) are matched case-insensitively and stored in the spelling
    given here. ``check`` is a predicate on the typed value; ``allowed`` describes, for
    error messages and docs, what passes it. ``normalize`` runs before type checking
    (e.g. int -> str). ``lmcache_names`` lists the names LMCache uses for the same setting
    (its own name included when identical). ``secret`` values are never shown; ``redact``
    hides the secret part of a shown string value (a URL's password). ``parse`` checks a
    value whose rules are too many for ``allowed`` (a URL's form): it raises ValueError
    naming the key and what is wrong, and that message is the problem.
    """

    name: str
    kind: type
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    check: Callable[[Any], bool] | None = None
    allowed: str = ""
    nullable: bool = False
    normalize: Callable[[Any], Any] | None = None
    lmcache_names: tuple[str, ...] = ()
    secret: bool = False
    redact: Callable[[str], str] | None = None
    parse: Callable[[Any], object] | None = None

    @property
    def env_var(self) -> str:
        """The environment variable that sets this key, e.g. ``KVTIER_CHUNK_SIZE``."""
        return ENV_PREFIX + self.name.upper()

    def describe_allowed(self) -> str:
        """Human-readable allowed values, e.g. ``one of LRU, LFU, FIFO, MRU``."""
        if self.allowed:
            text = self.allowed
        elif self.choices:
            text = "one of " + ", ".join(self.choices)
        else:
            text = _TYPE_NAMES[self.kind]
        return f"{text}, or null" if self.nullable else text

    @property
    def annotation(self) -> Any:
        """The type of the config attribute: ``kind``, or ``kind | None`` when nullable."""
        return self.kind | None if self.nullable else self.kind

    def shown(self, value: Any) -> str:
        """``value`` as logs, tables and error messages show it: a secret as ``'***'``,
        a string with its secret part redacted."""
        return repr(self.public(value))

    def public(self, value: Any) -> Any:
        """``value`` as it may be printed (``kvtier info``, its JSON): a secret as
        ``***``, a string with its secret part redacted, anything else as it is."""
        if self.secret and value is not None:
            return "***"
        if self.redact is not None and isinstance(value, str):
            return self.redact(value)
        return value


def key_registry(*groups: Iterable[KeySpec]) -> dict[str, KeySpec]:
    """The keys of ``groups``, in order: key name -> KeySpec.

    Raises:
        ValueError: two groups declare the same key.
    """
    keys: dict[str, KeySpec] = {}
    for spec in (spec for group in groups for spec in group):
        if spec.name in keys:
            raise ValueError(f"config key {spec.name!r} is declared twice")
        keys[spec.name] = spec
    return keys


def key_fields(keys: Mapping[str, KeySpec]) -> Callable[[type], type]:
    """A class decorator, applied before ``@dataclass``: one field per key (its name, type
    and default), in registry order, ahead of the fields the class declares itself."""

    def add_fields(cls: type) -> type:
        own = inspect.get_annotations(cls)
        for name, spec in keys.items():
            setattr(cls, name, spec.default)
        cls.__annotations__ = {**{n: s.annotation for n, s in keys.items()}, **own}
        return cls

    return add_fields


def coerce(
    spec: KeySpec, raw: Any, *, origin: str, problems: list[str], from_env: bool = False
) -> Any:
    """Return ``raw`` validated and normalized for ``spec``, or None after adding a problem.

    Strict for YAML/override values (a bool is not an int, "256" is not an int, an int is
    a float); ``from_env`` parses strings to the key's type first. An empty environment
    string means null for a nullable key.
    """

    def reject(detail: str = "") -> None:
        where = f"{spec.name}: {spec.shown(raw)} from {origin} is not allowed; "
        problems.append(where + f"expected {spec.describe_allowed()}{detail}")

    value = raw
    if from_env and isinstance(raw, str):
        if raw == "" and spec.nullable:
            return None
        if spec.kind is not str:
            value = parse_env_text(spec.kind, raw)
            if value is None:
                spellings = " (true/false, 1/0, yes/no, on/off)" if spec.kind is bool else ""
                reject(spellings)
                return None
    if value is None:
        if not spec.nullable:
            reject(" (got null)")
        return None
    if spec.normalize is not None:
        value = spec.normalize(value)
        if value is None and spec.nullable:
            return None

    if spec.kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, spec.kind) or (spec.kind is not bool and isinstance(value, bool)):
        reject(f" (got {type(value).__name__})")
        return None
    if spec.choices:
        canonical = {c.lower(): c for c in spec.choices}.get(value.strip().lower())
        if canonical is None:
            reject()
            return None
        value = canonical
    if spec.check is not None and not spec.check(value):
        reject()
        return None
    if spec.parse is not None:
        try:
            spec.parse(value)
        except ValueError as exc:
            problems.append(f"{origin}: {exc}")
            return None
    return value


def empty_as(replacement: Any) -> Callable[[Any], Any]:
    """A ``KeySpec.normalize``: an empty string becomes ``replacement`` (null, or the
    key's default); any other value is kept for the type check, so that a list or a
    ``false`` given for a string key is an error, not an empty string."""
    return lambda value: replacement if value == "" else value


def parse_env_text(kind: type, text: str) -> Any:
    """Parse an environment string to ``kind`` (bool, int, float); None when it does not."""
    text = text.strip()
    if kind is bool:
        lowered = text.lower()
        return True if lowered in _ENV_TRUE else False if lowered in _ENV_FALSE else None
    try:
        return kind(text)
    except ValueError:
        return None


def yaml_literal(value: Any) -> str:
    """``value`` spelled as in YAML for messages and docs: null, true, 'LRU', 256."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


def suggest(name: str, candidates: Iterable[str]) -> str:
    """``; did you mean 'x'?`` naming the candidate closest to ``name``, or ``""``."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""
