"""kvtier in a vLLM engine with tensor parallelism (two worker processes): every rank
stores and loads its own shard, bit for bit, and a chunk is a hit only when every rank
holds it."""

from __future__ import annotations

import pytest
from support.engines import expected_loaded, prompts_of, run_support_script

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK, CHUNK, TP = 32, 64, 2
LENGTHS = [300, 200, 40]


@pytest.fixture(scope="module")
def tensor_parallel(model_a, tmp_path_factory):
    prompts = prompts_of(LENGTHS, seed=3)
    config = {
        "model": str(model_a),  # 2 KV heads: one per rank
        "prompts": prompts,
        "block_size": BLOCK,
        "chunk_size": CHUNK,
        "tensor_parallel_size": TP,
    }
    return prompts, run_support_script(
        "vllm_parallel.py", config, tmp_path_factory.mktemp("tensor-parallel") / "result.json"
    )


def test_every_rank_loads_its_shard_bit_for_bit(tensor_parallel):
    prompts, result = tensor_parallel
    assert result["layers"] == 2 * TP  # the probe read each rank's layers
    assert result["loaded"] == [
        expected_loaded(len(p), chunk_size=CHUNK, block_size=BLOCK) for p in prompts
    ]
    for length, mismatch in zip(LENGTHS, result["loaded_mismatch"], strict=True):
        assert mismatch is None, f"{length}-token prompt: KV differs at (layer, block) {mismatch}"
    assert result["tokens"]["warm"] == result["tokens"]["cold"]


def test_every_rank_answers_and_stores_its_own_chunks(tensor_parallel):
    prompts, result = tensor_parallel
    chunks = sum(len(p) // CHUNK for p in prompts)
    assert result["stored_chunks"] == [chunks] * TP


def test_a_chunk_one_rank_lacks_is_a_miss_for_all(tensor_parallel):
    _, result = tensor_parallel
    assert result["cleared"]
    assert result["loaded_after_clear"] == [0] * len(LENGTHS)


def test_shutdown_removes_every_ranks_socket(tensor_parallel):
    _, result = tensor_parallel
    assert result["sockets_left"] == []
