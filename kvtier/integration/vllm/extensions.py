"""The registry of the connector's optional features, by name, as in vLLM's
``kv_offload/factory.py``: each is one module plus one ``Extension`` line below.

A feature's module defines ``scheduler_extension(config, vllm_config, client)`` and
``worker_extension(config, vllm_config)``, each returning a ``SchedulerExtension`` /
``WorkerExtension`` (``common``) or None, and optionally ``check(config, vllm_config)``,
which refuses at start-up what the feature cannot serve. It is imported only when
``enabled`` says the feature is on, so a connector without it never loads it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.config import KVTierConfig
from kvtier.integration.vllm.common import SchedulerExtension, WorkerExtension
from kvtier.integration.vllm.facts import kv_events_enabled

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvtier.integration.vllm.rpc import RpcClient


@dataclass(frozen=True, slots=True)
class Extension:
    """One optional feature: its name, its module, and when it is on."""

    name: str
    module: str
    enabled: Callable[[KVTierConfig, VllmConfig], bool]


EXTENSIONS = (
    Extension("kv_events", "kvtier.integration.vllm.kv_events", lambda c, v: kv_events_enabled(v)),
    Extension("blend", "kvtier.blend.vllm_extension", lambda c, v: c.enable_blending),
)


def _modules(config: KVTierConfig, vllm_config: VllmConfig):
    for extension in EXTENSIONS:
        if extension.enabled(config, vllm_config):
            yield importlib.import_module(extension.module)


def check_extensions(config: KVTierConfig, vllm_config: VllmConfig) -> None:
    """Refuse at start-up what an enabled feature cannot serve (its error names why)."""
    for module in _modules(config, vllm_config):
        check = getattr(module, "check", None)
        if check is not None:
            check(config, vllm_config)


def scheduler_extensions(
    config: KVTierConfig, vllm_config: VllmConfig, client: RpcClient
) -> list[SchedulerExtension]:
    """The scheduler-side objects of the features this engine has on; ``client`` asks
    every worker rank's lookup socket."""
    built = (
        m.scheduler_extension(config, vllm_config, client) for m in _modules(config, vllm_config)
    )
    return [extension for extension in built if extension is not None]


def worker_extensions(config: KVTierConfig, vllm_config: VllmConfig) -> list[WorkerExtension]:
    """The worker-side objects of the features this engine has on."""
    built = (m.worker_extension(config, vllm_config) for m in _modules(config, vllm_config))
    return [extension for extension in built if extension is not None]
