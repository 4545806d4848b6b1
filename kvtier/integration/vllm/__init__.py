"""kvtier as a vLLM KV connector.

Enable it with::

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
                           "kv_connector_module_path": "kvtier.integration.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"chunk_size": 256}}'

``KVTierConnector`` is imported lazily, so the vLLM-free parts of this package (the
scheduler-side planning, the worker side, the lookup RPC) import without vLLM.
"""

from typing import Any

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name in ("KVTierConnector", "KVTierConnectorMetadata", "KVTierConnectorStats"):
        from kvtier.integration.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
