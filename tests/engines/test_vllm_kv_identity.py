"""kvtier's guarantee, checked on the engine's own KV blocks (``KVProbe``): what a hit
loads is bit-identical to what the cold prefill computed, and an engine that stores
through kvtier computes exactly the KV of an engine without a connector.

The model is bf16 with small random weights (near-tied logits): token equality between
differently scheduled computations would be fragile there, the KV comparison is not.

A sliding-window Mistral (float32, window 64) checks hits beyond the first window: a
600-token prompt whose first 384 tokens vLLM's own cache held when kvtier stored it (so
kvtier lacks their chunks) is served from kvtier alone, resuming at token 576 from the
chunk of its window, [512, 576). And a hit past vLLM's own needs no chunk inside it: with
vLLM holding a prompt's first 160 tokens and kvtier's first chunk evicted, the rest loads.
"""

from __future__ import annotations

import pytest
from support.engines import expected_loaded, prompts_of, run_support_script
from support.models import make_tiny_mistral

from kvtier.demo_vllm import build_llama

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK, CHUNK = 32, 64
LENGTHS = [700, 304, 128, 63, 200, 40]  # one batch: long, ragged, shorter than a chunk


@pytest.fixture(scope="module")
def kv_identity(tmp_path_factory):
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("kv-identity")
    model = build_llama(tmp / "llama-bf16", num_layers=3, num_heads=4, num_kv_heads=2, head_size=64)
    prompts = prompts_of(LENGTHS, seed=7)
    config = {
        "model": str(model),
        "prompts": prompts,
        "block_size": BLOCK,
        "chunk_size": CHUNK,
        "dtype": "bfloat16",
        "window": {
            "model": str(make_tiny_mistral(tmp / "mistral-window64", sliding_window=64)),
            "prompt": prompts_of([600], seed=5)[0],
            "shared": 400,
            "block_size": BLOCK,
            "chunk_size": CHUNK,
        },
    }
    return prompts, run_support_script("vllm_kv_identity.py", config, tmp / "result.json")


def test_loaded_kv_is_bit_identical_to_the_cold_prefill(kv_identity):
    prompts, result = kv_identity
    assert result["loaded"] == [
        expected_loaded(len(p), chunk_size=CHUNK, block_size=BLOCK) for p in prompts
    ]
    for length, mismatch in zip(LENGTHS, result["loaded_mismatch"], strict=True):
        assert mismatch is None, f"{length}-token prompt: KV differs at (layer, block) {mismatch}"


def test_the_probe_sees_a_flipped_bit_where_it_is(kv_identity):
    _, result = kv_identity
    found, flipped = result["flipped"]
    assert found == flipped


def test_storing_leaves_the_engines_kv_as_without_a_connector(kv_identity):
    """Same batch, same process and thread count: the engine with kvtier (storing every
    chunk) holds the same KV bytes, and gives the same tokens, as one without."""
    _, result = kv_identity
    for length, mismatch in zip(LENGTHS, result["connector_vs_plain_mismatch"], strict=True):
        assert mismatch is None, f"{length}-token prompt: KV differs at (layer, block) {mismatch}"
    assert result["tokens"]["cold"] == result["tokens"]["plain"]


def test_a_hit_past_vllms_own_needs_no_chunk_inside_it(kv_identity):
    """vLLM holds the 700-token prompt's first 160 tokens; kvtier lost c0: it loads
    [160, 640) (c2 from token 160, c3..c9), as the cold prefill computed it."""
    _, result = kv_identity
    assert result["local"] == {"cached": 640, "mismatch": None}, result["local"]


def test_a_sliding_window_hit_loads_its_window_bit_identical(kv_identity):
    """vLLM holds tokens from window_start(576) = 513 on, blocks 16 and 17: kvtier loads
    them from c8 alone (c0..c4 it never stored), as a cold prefill computed them, and the
    request generates what one that vLLM's own prefix cache resumes at 576 does."""
    _, result = kv_identity
    window = result["window"]
    assert (window["loaded"], window["loaded_blocks"]) == (576, [16, 17]), window
    assert window["loaded_vs_stored"] is None and window["loaded_vs_cold"] is None, window
    assert window["alike_cached"] == 576 and window["tokens_equal"], window
