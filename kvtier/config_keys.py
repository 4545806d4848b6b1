"""Config keys: what one key is (``KeySpec``), how a dataclass field declares one
(``key``), how a raw value becomes a valid one (``coerce``), and the normalizers and
checks that declarations use.

``kvtier.config`` declares every key of ``KVTierConfig`` with :func:`key`; the registry
``CONFIG_KEYS`` is read back from the fields with :func:`key_specs`.

Values come typed from YAML files and mappings (checked strictly) or as text from
environment variables (parsed to the key's type first). Problems are collected, not
raised: :func:`coerce` appends one line per problem naming the key, the value, where it
came from and what is allowed, so a config with several problems reports them all at
once in one :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

ENV_PREFIX = "KVTIER_"

_SPEC = "kvtier.config.KeySpec"  # dataclass field-metadata slot holding a field's KeySpec
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

    ``kind`` is one of bool, int, float, str. ``choices`` (str keys) are matched
    case-insensitively and stored in the spelling given here. ``check`` is a predicate on
    the typed value; ``allowed`` describes, for error messages and docs, what passes it.
    ``normalize`` runs before type checking (e.g. int -> str). ``lmcache_names`` lists the
    names LMCache uses for the same setting (its own name included when identical).
    ``secret`` values are never shown; ``redact`` hides the secret part of a shown string
    value (a URL's password).
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

    def shown(self, value: Any) -> str:
        """``value`` as logs, tables and error messages show it: a secret as ``'***'``,
        a string with its secret part redacted."""
        if self.secret and value is not None:
            return "'***'"
        if self.redact is not None and isinstance(value, str):
            return repr(self.redact(value))
        return repr(value)


def key(
    default: Any,
    kind: type,
    help: str,
    *,
    choices: Iterable[str] = (),
    check: Callable[[Any], bool] | None = None,
    allowed: str = "",
    nullable: bool = False,
    normalize: Callable[[Any], Any] | None = None,
    lmcache_names: Iterable[str] = (),
    secret: bool = False,
    redact: Callable[[str], str] | None = None,
) -> Any:
    """A dataclass field carrying its KeySpec; the name is filled in from the field."""
    spec = KeySpec(
        name="",
        kind=kind,
        default=default,
        help=help,
        choices=tuple(choices),
        check=check,
        allowed=allowed,
        nullable=nullable,
        normalize=normalize,
        lmcache_names=tuple(lmcache_names),
        secret=secret,
        redact=redact,
    )
    return field(default=default, metadata={_SPEC: spec})


def key_specs(cls: type) -> dict[str, KeySpec]:
    """The keys that dataclass ``cls`` declares with :func:`key`, in field order: its
    own fields first, then those it inherits."""
    own = set(vars(cls).get("__annotations__", {}))
    fields = sorted(dataclasses.fields(cls), key=lambda f: f.name not in own)
    return {
        f.name: dataclasses.replace(f.metadata[_SPEC], name=f.name)
        for f in fields
        if _SPEC in f.metadata
    }


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
    return value


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


# --------------------------------------------------------------------------------------
# Value helpers of key declarations: normalizers and checks
# --------------------------------------------------------------------------------------


def levels_text(value: Any) -> Any:
    """A levels schedule as text: YAML may give an int or a list of ints."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, list | tuple) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return ",".join(map(str, value))
    return value.replace(" ", "") if isinstance(value, str) else value


LEVELS_ALLOWED = "empty, or comma-separated integers from 1 to 127 (one, or one per layer)"


def valid_levels_text(text: str) -> bool:
    """Whether ``text`` (after ``levels_text``) is a levels schedule."""
    if not text:
        return True
    parts = text.split(",")
    return all(p.isdigit() and 1 <= int(p) <= 127 for p in parts)


def parse_levels(text: str, num_layers: int, key: str) -> list[int] | None:
    """The per-layer levels ``text`` (a ``cachegen_*_levels`` value) sets for a model of
    ``num_layers`` layers; None for the default schedule.

    Raises:
        ValueError: ``text`` lists a number of layers other than 1 or ``num_layers``
            (the message names ``key``).
    """
    if not text:
        return None
    levels = [int(p) for p in text.split(",")]
    if len(levels) == 1:
        return levels * num_layers
    if len(levels) != num_layers:
        raise ValueError(
            f"{key} lists {len(levels)} layers, the model has {num_layers}: give one "
            "integer for every layer or exactly one per layer"
        )
    return levels


def strip_file_scheme(path: str) -> str:
    """LMCache spells ``local_disk`` as ``file:///path``; kvtier takes either."""
    return path[len("file://") :] if path.startswith("file://") else path


def int_to_str(value: Any) -> Any:
    """An int as a string (keys whose strings YAML may give as numbers)."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0
