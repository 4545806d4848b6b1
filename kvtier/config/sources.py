"""The sources of a configuration, each read into validated settings for ``load_config``:
which YAML file to read (:func:`resolve_config_file`), the file itself, a mapping of
kvtier and LMCache keys (overrides, or a file's contents), the ``KVTIER_*`` variables and
LMCache's ``LMCACHE_*`` variables.

Every reader collects its problems in the caller's list instead of raising, so that
``load_config`` reports the problems of all sources together.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from kvtier.config.keys import ENV_PREFIX, KeySpec, coerce, suggest
from kvtier.config.lmcache import (
    LMCACHE_NO_EFFECT_KEYS,
    LMCACHE_PLANNED_KEYS,
    LMCACHE_UNSUPPORTED_KEYS,
    check_lmcache_feature_key,
    is_lmcache_feature_key,
    lmcache_aliases,
)
from kvtier.logs import LOG_LEVEL_ENV_VAR, env_log_level

logger = logging.getLogger(__name__)

CONFIG_FILE_KEY = "config_file"
CONFIG_FILE_ENV_VAR = "KVTIER_CONFIG_FILE"
# LMCache's own variable naming its YAML file; read when kvtier is given no file.
LMCACHE_CONFIG_FILE_ENV_VAR = "LMCACHE_CONFIG_FILE"
# The prefix of LMCache's variables: LMCACHE_<KEY> sets LMCache's key <key>.
LMCACHE_ENV_PREFIX = "LMCACHE_"
# KVTIER_* variables that are not config keys; load_config leaves their values to their
# readers. KVTIER_LOG_LEVEL is ``kvtier.logs``' (read as each process sets its logging up,
# and checked with the keys, so that the first config hook an engine gives kvtier reports
# a bad level once). KVTIER_TUNING_DIR is the kernels' own variable, read by
# ``kvtier_kernels.tuning.lookup`` alone; the ``tuning_dir`` key (extra config or YAML)
# goes before it on the search path.
RESERVED_ENV_VARS = frozenset({CONFIG_FILE_ENV_VAR, LOG_LEVEL_ENV_VAR, "KVTIER_TUNING_DIR"})

# One source's settings: kvtier key -> (validated value, source label).
Settings = dict[str, tuple[Any, str]]


@dataclass(frozen=True, slots=True)
class ConfigFile:
    """The YAML file a configuration reads; ``from_lmcache``: named by LMCACHE_CONFIG_FILE."""

    path: str
    from_lmcache: bool = False

    @property
    def origin(self) -> str:
        """The source label of its values: ``file PATH`` or ``LMCACHE_CONFIG_FILE file PATH``."""
        prefix = f"{LMCACHE_CONFIG_FILE_ENV_VAR} " if self.from_lmcache else ""
        return f"{prefix}file {self.path}"

    @property
    def described(self) -> str:
        """How problems with the file itself name it."""
        return self.origin if self.from_lmcache else f"config file {self.path}"


def resolve_config_file(
    config_file: str | os.PathLike[str] | None,
    from_overrides: Any,
    env: Mapping[str, str],
    problems: list[str],
) -> ConfigFile | None:
    """The YAML file to read: ``config_file``, else ``from_overrides`` (the overrides'
    ``config_file``), else ``$KVTIER_CONFIG_FILE``, else ``$LMCACHE_CONFIG_FILE``; None
    for none. An empty ``from_overrides`` or variable is none, as null is. When kvtier is given a file of its own, LMCACHE_CONFIG_FILE is ignored with
    one warning."""
    if config_file is not None:
        chosen, given_as = os.fspath(config_file), "the config_file argument"
    elif from_overrides is not None and from_overrides != "":
        if not isinstance(from_overrides, str | os.PathLike):
            problems.append(
                f"{CONFIG_FILE_KEY}: {from_overrides!r} from override is not allowed; "
                "expected a file path"
            )
            return None
        chosen, given_as = os.fspath(from_overrides), f"{CONFIG_FILE_KEY} from override"
    else:
        chosen, given_as = env.get(CONFIG_FILE_ENV_VAR) or None, CONFIG_FILE_ENV_VAR
    lmcache_file = env.get(LMCACHE_CONFIG_FILE_ENV_VAR) or None
    if chosen is None:
        return None if lmcache_file is None else ConfigFile(lmcache_file, from_lmcache=True)
    if lmcache_file is not None:
        logger.warning(
            "%s (%s) is ignored in favour of %s (%s)",
            LMCACHE_CONFIG_FILE_ENV_VAR,
            lmcache_file,
            given_as,
            chosen,
        )
    return ConfigFile(chosen)


def read_yaml_file(file: ConfigFile, problems: list[str]) -> Mapping[Any, Any]:
    """The top-level mapping of ``file``; empty after adding a problem."""
    try:
        with open(file.path, encoding="utf-8") as stream:
            data = yaml.safe_load(stream)
    except FileNotFoundError:
        problems.append(f"{file.described} does not exist")
        return {}
    except OSError as err:
        problems.append(f"{file.described} cannot be read: {err.strerror or err}")
        return {}
    except yaml.YAMLError as err:
        problems.append(f"{file.described} is not valid YAML: {err}")
        return {}
    except UnicodeDecodeError as err:
        problems.append(f"{file.described} is not UTF-8 text: {err}")
        return {}
    if data is None:  # an empty file
        return {}
    if not isinstance(data, Mapping):
        problems.append(
            f"{file.described} must hold a mapping of keys to values at the top level, "
            f"not a {type(data).__name__}"
        )
        return {}
    return data


def read_mapping(
    data: Mapping[Any, Any],
    origin: str,
    keys: Mapping[str, KeySpec],
    problems: list[str],
    ignored: set[str],
) -> Settings:
    """Validate one mapping (overrides or a YAML file) of kvtier and LMCache keys.

    Args:
        data: the mapping.
        origin: how sources and problems name it (``override``, ``file PATH``).
        keys: the config keys (``CONFIG_KEYS``).
        problems: where problems are added.
        ignored: where the no-effect LMCache keys found are added.
    """
    aliases = lmcache_aliases(keys)
    settings: Settings = {}
    given_as: dict[str, str] = {}  # kvtier key -> the name it was given under
    for name, raw in data.items():
        if not isinstance(name, str):
            problems.append(f"key {name!r} in {origin} is not a string")
            continue
        key = name if name in keys else aliases.get(name)
        if key is not None:
            if key in given_as:
                problems.append(f"{origin} sets {key} twice, as {given_as[key]!r} and as {name!r}")
                continue
            given_as[key] = name
            label = origin if name == key else f"{origin} (as {name})"
            settings[key] = (coerce(keys[key], raw, origin=label, problems=problems), label)
        elif name in LMCACHE_NO_EFFECT_KEYS:
            ignored.add(name)
        elif is_lmcache_feature_key(name):
            if problem := check_lmcache_feature_key(name, raw, origin):
                problems.append(problem)
        elif name == CONFIG_FILE_KEY:
            problems.append(f"{CONFIG_FILE_KEY!r} cannot be set inside {origin}")
        else:
            known = _known_names(keys, aliases)
            hint = suggest(name, known) or suggest(_bare_name(name), known)
            problems.append(f"unknown key {name!r} in {origin}{hint}")
    return settings


def read_env(env: Mapping[str, str], keys: Mapping[str, KeySpec], problems: list[str]) -> Settings:
    """Validate the ``KVTIER_*`` variables of ``env`` against ``keys``, and
    ``KVTIER_LOG_LEVEL``."""
    env_vars = {spec.env_var: spec.name for spec in keys.values()}
    settings: Settings = {}
    try:
        env_log_level(env)
    except ValueError as exc:
        problems.append(str(exc))
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in RESERVED_ENV_VARS:
            continue
        key = env_vars.get(var)
        if key is None:
            candidates = [*env_vars, *RESERVED_ENV_VARS]
            problems.append(f"unknown environment variable {var}{suggest(var, candidates)}")
            continue
        label = f"env var {var}"
        value = coerce(keys[key], env[var], origin=label, problems=problems, from_env=True)
        settings[key] = (value, label)
    return settings


def read_lmcache_env(
    env: Mapping[str, str], keys: Mapping[str, KeySpec], problems: list[str], ignored: set[str]
) -> Settings:
    """Validate LMCache's ``LMCACHE_<KEY>`` variables of ``env``, as LMCache reads them.

    A variable of an LMCache key that a kvtier key shares (``lmcache_names``) sets that
    key; one of a no-effect LMCache key is added to ``ignored``; one of an LMCache feature
    kvtier lacks is accepted only while it leaves the feature off. A value in matching
    quotes is read without them, and a boolean is ``true``/``1`` or ``false``/``0`` (any
    case), the spellings LMCache tells apart. Variables that are not LMCache config keys
    (``LMCACHE_CONFIG_FILE``, ``LMCACHE_LOG_LEVEL``...) are left to their readers.
    """
    lmcache_keys = {lm: spec.name for spec in keys.values() for lm in spec.lmcache_names}
    settings: Settings = {}
    given_as: dict[str, str] = {}  # kvtier key -> the variable that set it
    for var in sorted(env):
        name = var[len(LMCACHE_ENV_PREFIX) :].lower()
        if not var.startswith(LMCACHE_ENV_PREFIX) or var != LMCACHE_ENV_PREFIX + name.upper():
            continue
        label, text = f"env var {var}", _unquoted(env[var])
        key = lmcache_keys.get(name)
        if key is not None:
            if key in given_as:
                problems.append(f"{key} is set twice, by {given_as[key]} and by {var}")
                continue
            given_as[key] = var
            spec = keys[key]
            if spec.kind is bool and text.strip().lower() not in _LMCACHE_BOOLS:
                problems.append(
                    f"{var}: {text!r} is not allowed; expected true/1 or false/0 "
                    "(LMCache reads any other value as false)"
                )
                continue
            label += "" if name == key else f" (as {name})"
            value = coerce(spec, text, origin=label, problems=problems, from_env=True)
            settings[key] = (value, label)
        elif name in LMCACHE_NO_EFFECT_KEYS:
            ignored.add(name)
        elif (
            name not in keys
            and is_lmcache_feature_key(name)
            and (problem := check_lmcache_feature_key(name, _env_literal(text), label))
        ):
            problems.append(problem)
    return settings


# The boolean spellings of LMCache's variables: true/1 are true, and it reads any other
# value as false, so kvtier accepts only these two for false.
_LMCACHE_BOOLS = frozenset({"true", "1", "false", "0"})


def _unquoted(text: str) -> str:
    """``text`` without one pair of matching outer quotes, as LMCache reads a variable."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _env_literal(text: str) -> Any:
    """A variable's text as the YAML value it spells (``false``, ``0``, ``5555``), so that
    a feature switched off in a variable reads as off; the text itself when it spells no
    YAML scalar."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, str | int | float | bool) or value is None else text


# Spellings of a key that belong to other inputs: its environment variable, or a prefix.
_FOREIGN_PREFIXES = (ENV_PREFIX.lower(), "lmcache_", "kvtier.", "lmcache.")


def _bare_name(name: str) -> str:
    """``name`` as a mapping spells a key, for the "did you mean" of an unknown key:
    ``KVTIER_CHUNK_SIZE``, ``kvtier.chunk_size`` and ``lmcache.chunk_size`` are
    ``chunk_size``."""
    lowered = name.lower()
    for prefix in _FOREIGN_PREFIXES:
        if lowered.startswith(prefix):
            return lowered[len(prefix) :]
    return lowered


def _known_names(keys: Mapping[str, KeySpec], aliases: Mapping[str, str]) -> list[str]:
    """Every key name any input may use; the candidates for "did you mean" suggestions."""
    return sorted(
        {CONFIG_FILE_KEY, *keys, *aliases, *LMCACHE_NO_EFFECT_KEYS}
        | {*LMCACHE_UNSUPPORTED_KEYS, *LMCACHE_PLANNED_KEYS}
    )
