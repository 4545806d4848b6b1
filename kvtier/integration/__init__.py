"""Integrations of kvtier into serving engines (``kvtier.integration.vllm``,
``kvtier.integration.sglang``)."""
