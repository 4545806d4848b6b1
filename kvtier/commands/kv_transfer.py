"""vLLM's ``--kv-transfer-config`` JSON as ``kvtier info`` checks it before an engine starts:
read as ``vllm serve`` reads it, and kvtier's connector entry found in it, whether kvtier is
the connector or one of a ``MultiConnector``'s.

``vllm serve`` expands bare numbers with a size suffix outside strings (``80g``: 80 * 10**9,
``4G``: 4 * 2**30) before it parses the JSON, then validates it as its ``KVTransferConfig``,
which refuses unknown fields; a ``MultiConnector`` builds one more ``KVTransferConfig`` from
each entry of ``kv_connector_extra_config.connectors``. Where vLLM is installed, the same
class checks the fields here that kvtier does not check itself.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvtier.config import ConfigError
from kvtier.config.keys import suggest

CONNECTOR = "KVTierConnector"  # kv_connector in vLLM's config
MODULE = "kvtier.integration.vllm"  # kv_connector_module_path: these two define CONNECTOR
MODULES = (MODULE, f"{MODULE}.connector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")  # what vLLM's KVTransferConfig takes
MULTI_CONNECTOR = "MultiConnector"
# The fields of a connector's entry that kvtier checks itself, with messages of its own.
OWN_FIELDS = ("kv_connector", "kv_connector_module_path", "kv_role", "kv_connector_extra_config")

_QUOTED = re.compile(r'("(?:[^"\\]|\\.)*")')
_SUFFIXED = re.compile(r"\b(\d+(?:\.\d+)?)([kKmMgGtT])\b")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse(text: str) -> dict[str, Any]:
    """The ``--kv-transfer-config`` JSON object, its bare suffixed numbers expanded as
    ``vllm serve`` does (``1k``: 1000, ``1K``: 1024; ``1.5K`` is refused).

    Raises:
        ConfigError: the text is not a JSON object.
    """
    parts = _QUOTED.split(text)
    try:
        for i in range(0, len(parts), 2):  # outside the strings
            parts[i] = _SUFFIXED.sub(_expanded, parts[i])
    except ValueError as exc:
        raise ConfigError([f"--kv-transfer-config: {exc}"]) from None
    try:
        transfer = json.loads("".join(parts))
    except ValueError as exc:
        raise ConfigError([f"--kv-transfer-config is not JSON: {exc}"]) from None
    if not isinstance(transfer, dict):
        raise ConfigError(["--kv-transfer-config must be a JSON object"])
    return transfer


def _expanded(match: re.Match[str]) -> str:
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return str(int(float(number) * _DECIMAL[suffix]))
    if "." in number:
        raise ValueError(
            f"{match.group()}: a binary suffix ({suffix}) takes a whole number; "
            f"did you mean {number}{suffix.lower()}?"
        )
    return str(int(number) * _BINARY[suffix])


def kvtier_extra_config(transfer: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """kvtier's ``kv_connector_extra_config`` in ``transfer`` (a parsed
    ``--kv-transfer-config``), kvtier's own or that of its entry in a ``MultiConnector``;
    ``{}`` when there is none. What vLLM or kvtier's connector would refuse in ``transfer``
    is added to ``problems``."""
    if transfer.get("kv_connector") != MULTI_CONNECTOR:
        problems += vllm_problems(transfer, "", own=OWN_FIELDS)
        return _connector_extra(transfer, problems)
    problems += vllm_problems(transfer, "")
    extra = transfer.get("kv_connector_extra_config")
    connectors = extra.get("connectors") if isinstance(extra, dict) else None
    if not isinstance(connectors, list) or not connectors:
        problems.append(
            f"{MULTI_CONNECTOR}: kv_connector_extra_config.connectors must be a list of "
            "connector configs"
        )
        return {}
    extras = []
    for i, entry in enumerate(connectors):
        where = f"{MULTI_CONNECTOR} connectors[{i}]: "
        if not isinstance(entry, dict):
            problems.append(f"{where}must be a JSON object")
            continue
        own = OWN_FIELDS if entry.get("kv_connector") == CONNECTOR else ()
        problems += vllm_problems(entry, where, own=own)
        if own:
            extras.append(_connector_extra(entry, problems, where))
    if not extras:
        problems.append(f"{MULTI_CONNECTOR}: no entry of connectors names {CONNECTOR!r}")
        return {}
    return extras[0]


def _connector_extra(entry: dict[str, Any], problems: list[str], where: str = "") -> dict[str, Any]:
    """The extra config of kvtier's connector entry (``where``: which, in messages), after
    kvtier's checks of its ``OWN_FIELDS``; their problems added to ``problems``."""
    if entry.get("kv_connector") != CONNECTOR:
        problems.append(
            f"{where}kv_connector is {entry.get('kv_connector')!r}; kvtier's is {CONNECTOR!r}"
        )
    if entry.get("kv_connector_module_path") not in MODULES:
        problems.append(
            f"{where}kv_connector_module_path is {entry.get('kv_connector_module_path')!r}; "
            f"kvtier's is {MODULE!r}"
        )
    role = entry.get("kv_role")
    if role not in KV_ROLES:
        problems.append(f"{where}kv_role is {role!r}; vLLM takes {', '.join(map(repr, KV_ROLES))}")
    extra = entry.get("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        problems.append(f"{where}kv_connector_extra_config must be a JSON object")
        return {}
    return extra


def vllm_problems(entry: dict[str, Any], where: str, own: tuple[str, ...] = ()) -> list[str]:
    """What vLLM's ``KVTransferConfig`` refuses in ``entry`` (``where``: which, in
    messages), the ``own`` fields left out (kvtier checks them itself); none where vLLM is
    not installed."""
    try:
        from pydantic import ValidationError
        from vllm.config import KVTransferConfig
    except ImportError:
        return []
    fields = set(KVTransferConfig.__dataclass_fields__)
    try:
        KVTransferConfig(**{k: v for k, v in entry.items() if k not in own})
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            name = ".".join(map(str, error["loc"]))
            if error["type"] == "unexpected_keyword_argument":
                hint = suggest(name, fields)
                problems.append(f"{where}{name!r} is not a field of vLLM's KVTransferConfig{hint}")
            else:
                field = f"{name}: " if name else ""  # a check of several fields has none
                problems.append(f"{where}{field}{error['msg']} (vLLM's KVTransferConfig)")
        return problems
    except (TypeError, ValueError) as exc:
        return [f"{where}{exc} (vLLM's KVTransferConfig)"]
    return []
