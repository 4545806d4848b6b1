"""kvtier configuration: one validated, immutable config object.

Every setting kvtier has is a key, declared once as a ``KeySpec`` (``keys``: type,
default, allowed values, help text, LMCache names) in the module of its concern:

    engine     chunks, hashing, storage names, kernels, buffers, metrics
    tiers      the CPU tier, the disk tier, the remote tier's URL, the codec
    remote     the remote_url schemes, and how a remote is reached
    connector  the vLLM connector's KV movement, loading, saving, disaggregation
    blend      CacheBlend

``CONFIG_KEYS`` composes those groups, and each key is a field of :class:`KVTierConfig`,
so a new key is one new ``KeySpec`` in its group.

``load_config`` merges four sources (``sources``), highest precedence first::

    overrides      a mapping, e.g. vLLM's ``kv_transfer_config.kv_connector_extra_config``
    environment    ``KVTIER_<KEY>`` variables (``KVTIER_CHUNK_SIZE=512``), then LMCache's
                   ``LMCACHE_<KEY>`` variables of the keys LMCache shares
    YAML file      ``config_file`` argument, else ``overrides["config_file"]``,
                   else ``$KVTIER_CONFIG_FILE``, else LMCache's ``$LMCACHE_CONFIG_FILE``
    defaults       the ``KeySpec`` defaults

NOTE: this package is the only place in kvtier that reads environment variables, and it
reads them only inside ``load_config``.

LMCache configs load too (``lmcache``): keys with the same meaning are accepted under
LMCache's names, operational LMCache knobs that mean nothing here are ignored with one
warning, and LMCache features kvtier does not have are accepted only while switched off.
``docs`` generates the key tables of docs/configuration.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import blend, connector, engine, remote, tiers
from kvtier.config.blend import blend_problems
from kvtier.config.keys import ConfigError, KeySpec, coerce, key_fields, key_registry
from kvtier.config.lmcache import lmcache_aliases
from kvtier.config.sources import (
    CONFIG_FILE_KEY,
    Settings,
    read_env,
    read_lmcache_env,
    read_mapping,
    read_yaml_file,
    resolve_config_file,
)

__all__ = ["CONFIG_KEYS", "LMCACHE_ALIASES", "ConfigError", "KVTierConfig", "load_config"]

logger = logging.getLogger(__name__)

GiB = 1 << 30  # sizes in GB are binary gigabytes (GiB, 2**30 bytes), as in LMCache


# --------------------------------------------------------------------------------------
# The config object
# --------------------------------------------------------------------------------------


# Every key, in the order that docs/configuration.md, ``describe()`` and ``to_dict()`` list.
CONFIG_KEYS: dict[str, KeySpec] = key_registry(
    engine.CHUNKS,
    tiers.CPU_TIER,
    engine.CHUNK_HASHES,
    engine.KERNELS,
    engine.NAMING,
    engine.BUFFERS,
    connector.KV_MOVEMENT,
    engine.METRICS,
    tiers.LOWER_TIERS,
    tiers.CODEC,
    remote.REMOTE_ACCESS,
    blend.BLEND,
    connector.CONNECTOR,
)

# LMCache names that differ from the kvtier key they set: LMCache name -> kvtier key.
LMCACHE_ALIASES: dict[str, str] = lmcache_aliases(CONFIG_KEYS)


@dataclass(frozen=True, slots=True, kw_only=True)
@key_fields(CONFIG_KEYS)
class KVTierConfig:
    """kvtier's validated settings: one attribute per key of ``CONFIG_KEYS``. Build it
    with :func:`load_config`.

    Constructing it directly (or through ``dataclasses.replace``) validates and normalizes
    every key too, raising :class:`ConfigError`; such a config has no recorded sources.
    ``ignored_lmcache_keys`` lists the no-effect LMCache keys the inputs contained.
    """

    # Not keys: what load_config saw. ``sources`` maps a key to where its value came from.
    ignored_lmcache_keys: tuple[str, ...] = field(default=(), compare=False)
    sources: dict[str, str] = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        problems: list[str] = []
        for spec in CONFIG_KEYS.values():
            raw = getattr(self, spec.name)
            value = coerce(spec, raw, origin="KVTierConfig(...)", problems=problems)
            if value is not raw:
                object.__setattr__(self, spec.name, value)
        object.__setattr__(self, "ignored_lmcache_keys", tuple(self.ignored_lmcache_keys))
        if self.local_disk and self.max_local_disk_size == 0:
            problems.append(
                f"max_local_disk_size: 0 is not allowed while local_disk is set "
                f"({self.local_disk!r}); give the disk tier's size in GB"
            )
        problems += blend_problems(self)
        if problems:
            raise ConfigError(problems)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVTierConfig:
        """Validate ``data`` (kvtier or LMCache key names) over the defaults.

        Same rules as ``load_config(overrides=data, env={})``: no environment variables
        are read, but ``data["config_file"]`` is honoured. Raises ConfigError.
        """
        return load_config(overrides=data, env={})

    @property
    def max_local_cpu_bytes(self) -> int:
        """``max_local_cpu_size`` in bytes (GB = 2**30 bytes), at least one: a size under a
        byte is a pool that no chunk fits (stores are skipped and counted), not an error."""
        return max(1, round(self.max_local_cpu_size * GiB))

    def to_dict(self) -> dict[str, Any]:
        """Every key and its value as a plain JSON-able dict.

        ``load_config(overrides=cfg.to_dict(), env={}) == cfg`` holds.
        """
        return {name: getattr(self, name) for name in CONFIG_KEYS}

    def source_of(self, key: str) -> str:
        """Where ``key``'s value came from: ``default``, ``override``, ``env var KVTIER_X``
        or ``env var LMCACHE_X``, ``file PATH`` or ``LMCACHE_CONFIG_FILE file PATH`` (with
        ``(as lmcache_name)`` when set under an LMCache alias), or ``argument`` for a value
        given to the constructor.
        Raises KeyError for unknown keys.
        """
        spec = CONFIG_KEYS[key]
        if key in self.sources:
            return self.sources[key]
        return "default" if getattr(self, key) == spec.default else "argument"

    def describe(self) -> str:
        """A table of every key, its value and its source, for ``kvtier info``."""
        rows = [(name, self._shown(name), self.source_of(name)) for name in CONFIG_KEYS]
        key_width = max(len("key"), *(len(r[0]) for r in rows))
        value_width = max(len("value"), *(len(r[1]) for r in rows))
        lines = [f"{'key':<{key_width}}  {'value':<{value_width}}  source"]
        lines += [f"{k:<{key_width}}  {v:<{value_width}}  {s}" for k, v, s in rows]
        if self.ignored_lmcache_keys:
            lines.append("ignored LMCache keys: " + ", ".join(self.ignored_lmcache_keys))
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: the keys that differ from their defaults (``key=value``), or
        ``defaults``. Secrets are masked."""
        changed = [
            f"{name}={self._shown(name)}"
            for name, spec in CONFIG_KEYS.items()
            if getattr(self, name) != spec.default
        ]
        return ", ".join(changed) if changed else "defaults"

    def public_value(self, name: str) -> Any:
        """``name``'s value as ``kvtier info`` prints it: secrets masked, a URL's password
        hidden (``KeySpec.public``)."""
        return CONFIG_KEYS[name].public(getattr(self, name))

    def _shown(self, name: str) -> str:
        """The value for display: secrets masked, a URL's password hidden."""
        return CONFIG_KEYS[name].shown(getattr(self, name))

    @property
    def max_local_disk_bytes(self) -> int:
        """``max_local_disk_size`` in bytes (GB = 2**30 bytes)."""
        return round(self.max_local_disk_size * GiB)


def load_config(
    overrides: Mapping[str, Any] | None = None,
    config_file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> KVTierConfig:
    """Build the validated config from overrides, ``KVTIER_*`` env vars, a YAML file, defaults.

    Args:
        overrides: highest-precedence values, kvtier or LMCache key names (vLLM's
            ``kv_connector_extra_config``). May hold ``config_file``.
        config_file: YAML file to read; beats ``overrides["config_file"]``,
            ``$KVTIER_CONFIG_FILE`` and ``$LMCACHE_CONFIG_FILE`` (read only when none of
            kvtier's is given; one warning says so when it is ignored). An LMCache YAML
            config is accepted.
        env: environment to read ``KVTIER_*``, ``LMCACHE_CONFIG_FILE`` and LMCache's
            ``LMCACHE_<KEY>`` variables from (a ``KVTIER_<KEY>`` beats an
            ``LMCACHE_<KEY>``, which beats the file); defaults to ``os.environ``.

    Returns:
        The config; ``cfg.sources`` records where each value came from.

    Raises:
        ConfigError: listing every problem found in any source (unknown keys with a
            suggestion, wrong types, values out of range, enabled unsupported LMCache
            features, unreadable files), not just the first.
    """
    env = os.environ if env is None else env
    problems: list[str] = []
    ignored: set[str] = set()

    override_data = dict(overrides or {})
    file_in_overrides = override_data.pop(CONFIG_FILE_KEY, None)
    file = resolve_config_file(config_file, file_in_overrides, env, problems)

    # Lowest precedence first; a later source replaces an earlier one's value.
    layers: list[Settings] = []
    if file is not None:
        file_data = read_yaml_file(file, problems)
        layers.append(read_mapping(file_data, file.origin, CONFIG_KEYS, problems, ignored))
    layers.append(read_lmcache_env(env, CONFIG_KEYS, problems, ignored))
    layers.append(read_env(env, CONFIG_KEYS, problems))
    layers.append(read_mapping(override_data, "override", CONFIG_KEYS, problems, ignored))
    if problems:
        raise ConfigError(problems)

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, spec in CONFIG_KEYS.items():
        values[name], sources[name] = spec.default, "default"
        for layer in layers:
            if name in layer:
                values[name], sources[name] = layer[name]

    if ignored:
        logger.warning(
            "ignoring LMCache config keys that have no effect in kvtier: %s",
            ", ".join(sorted(ignored)),
        )
    config = KVTierConfig(**values, ignored_lmcache_keys=tuple(sorted(ignored)))
    object.__setattr__(config, "sources", sources)
    return config
