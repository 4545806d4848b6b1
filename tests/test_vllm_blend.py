"""CacheBlend behind the vLLM connector: refused at start-up (unsupported model class, or
"not supported yet"), and no effect at all with ``enable_blending`` off."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvtier.blend import UnsupportedModelError
from kvtier.config import KVTierConfig
from kvtier.integration.vllm.connector import check_blending


def _vllm_config(**hf_fields) -> SimpleNamespace:
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(**hf_fields)))


def test_unsupported_model_is_named() -> None:
    config = KVTierConfig(enable_blending=True)
    vllm_config = _vllm_config(architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        check_blending(vllm_config, config)


def test_blendable_model_is_refused_until_the_connector_blends() -> None:
    config = KVTierConfig(enable_blending=True)
    vllm_config = _vllm_config(architectures=["LlamaForCausalLM"], rope_theta=10000.0)
    with pytest.raises(ValueError, match="not supported yet"):
        check_blending(vllm_config, config)


def test_blending_off_changes_nothing() -> None:
    check_blending(_vllm_config(architectures=["GPT2LMHeadModel"]), KVTierConfig())
