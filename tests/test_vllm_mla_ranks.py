"""An MLA cache under tensor parallelism: stored once per pipeline stage, not per rank.

Every tensor-parallel rank of an MLA engine holds the whole latent cache, byte for byte,
so the ranks of one stage key their chunks alike; stages hold other layers and keep their
own keys. Rank 0 of a stage alone writes the shared tiers; the other ranks keep their own
memory and local disk copies and read the shared tier that rank 0 writes.

    ranks (TP=2, PP=2)   0 1 | 2 3        MLA keys   stage 0 of 2 | stage 1 of 2
    remote (fs://)       rank 0 and rank 2 write; ranks 1 and 3 read it

So is a KV head that vLLM gives to several ranks (fewer KV heads than ranks): the ranks
that hold one head key it alike, keyed by the head, and the first of them writes it.

    ranks (TP=4, 2 KV heads)   0 1 2 3    keys   head 0 of 2 (ranks 0, 1) | head 1 (2, 3)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.kv import bits
from support.worker_rig import random_paged

from kvtier.config import load_config
from kvtier.engine import EngineMetadata
from kvtier.integration.vllm import facts
from kvtier.integration.vllm.common import LoadSpec, SaveSpec, StepPlan
from kvtier.integration.vllm.kv_events import KVEventWorking
from kvtier.integration.vllm.worker import WorkerSide
from kvtier.observability.stats import Counter, TierCounter, tier_counter
from kvtier_kernels import PagedKV

LAYERS, BLOCK, CHUNK, LATENT = 2, 4, 8, 48
NUM_BLOCKS = 16
SRC, DST = [9, 2, 14, 5, 11, 0], [3, 12, 7, 1, 15, 6]
NUM_TOKENS = len(SRC) * BLOCK  # three chunks
SKIPPED = tier_counter("fs", TierCounter.SKIPPED_REPLICA)

# kind -> layout, backend, KV heads a rank, head size
KINDS = {
    "mla": ("mla", "FLASHMLA", 1, LATENT),
    "mha": ("vllm_hnd", "FLASH_ATTN", 2, LATENT // 2),  # heads of its own on every rank
    "gqa": ("vllm_hnd", "FLASH_ATTN", 1, LATENT // 2),  # one head a rank
}


def make_cache(kind: str) -> PagedKV:
    """The same random cache on every call: the ranks' replicated latent or head."""
    layout, _, heads, head_size = KINDS[kind]
    return random_paged(LAYERS, NUM_BLOCKS, BLOCK, heads, head_size, layout)


@pytest.fixture
def engine_ranks(tmp_path: Path) -> Iterator:
    """Builds the registered ranks of one engine (``tp x pp``), sharing a local disk root
    and an ``fs://`` remote; shuts them down after. ``head_replicas``: the ranks in a row
    vLLM gives one KV head (default: all ``tp``, as at one KV head)."""
    made: list[WorkerSide] = []

    def build(
        kind: str, tp: int, pp: int = 1, head_replicas: int | None = None, **overrides
    ) -> list[tuple[WorkerSide, PagedKV]]:
        _, backend, _, _ = KINDS[kind]
        config = load_config(
            {
                "chunk_size": CHUNK,
                "max_local_cpu_size": 0.01,
                "kernel_backend": "torch",
                "local_disk": str(tmp_path / "disk"),
                "max_local_disk_size": 0.01,
                "remote_url": f"fs://{tmp_path / 'remote'}",
                **overrides,
            },
            env={},
        )
        ranks = []
        for rank in range(tp * pp):
            worker = WorkerSide(
                config,
                EngineMetadata("test-model", tp * pp, rank),
                None,
                record_events=True,
                extensions=[KVEventWorking()],
                mla_replicas=tp,
                head_replicas=tp if head_replicas is None else head_replicas,
            )
            made.append(worker)
            paged = make_cache(kind)
            names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
            worker.register_kv_caches(dict(zip(names, paged.tensors, strict=True)), backend)
            ranks.append((worker, paged))
        return ranks

    yield build
    for worker in made:
        worker.shutdown()


def chunk_hashes(worker: WorkerSide) -> list[bytes]:
    return worker.engine.chunker.chunk_hashes(torch.arange(NUM_TOKENS))


def save(worker: WorkerSide, hashes: list[bytes]) -> None:
    worker.start_load(StepPlan(saves=[SaveSpec("req-a", 0, hashes, NUM_TOKENS, list(SRC))]))
    worker.wait_for_save()


def load(worker: WorkerSide, hashes: list[bytes]) -> set[int]:
    spec = LoadSpec("req-b", 0, hashes, NUM_TOKENS, 0, NUM_TOKENS, list(DST), False)
    worker.start_load(StepPlan(loads=[spec]))
    worker.wait_for_save()
    return worker.take_load_errors()


def assert_same_blocks(paged: PagedKV, got: list[int], want: list[int], what: str) -> None:
    for layer in range(paged.num_layers):
        view = paged.layer_view(layer)
        diff = bits(view[:, got]) != bits(view[:, want])
        if diff.any():
            plane, j, offset, head, dim = (int(i) for i in diff.nonzero()[0])
            raise AssertionError(
                f"{what}: layer {layer}, plane {plane}, block {got[j]} (#{j}) vs "
                f"{want[j]}, offset {offset}, head {head}, dim {dim}"
            )


def stored_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_mla_keys_are_one_per_pipeline_stage(engine_ranks):
    ranks = engine_ranks("mla", tp=2, pp=2)
    keys = [worker.engine.chunker.key(b"\x07" * 16) for worker, _ in ranks]
    assert [(k.world_size, k.rank) for k in keys] == [(2, 0), (2, 0), (2, 1), (2, 1)]
    assert keys[0] == keys[1] and keys[2] == keys[3], "TP ranks of a stage key apart"
    assert keys[0] != keys[2], "pipeline stages share keys"
    assert [w.metadata.worker_rank for w, _ in ranks] == [0, 1, 2, 3]
    disks = {w.engine.storage.lower[0].root.name for w, _ in ranks}
    assert disks == {f"rank{r}of4" for r in range(4)}, "each rank keeps its own disk"


@pytest.mark.parametrize(
    ("kind", "head_replicas"), [("mha", 2), ("gqa", 1)], ids=["heads-a-rank", "kv-heads-eq-tp"]
)
def test_other_caches_keep_a_key_per_rank(engine_ranks, kind, head_replicas):
    ranks = engine_ranks(kind, tp=2, pp=2, head_replicas=head_replicas)
    keys = [worker.engine.chunker.key(b"\x07" * 16) for worker, _ in ranks]
    assert [(k.world_size, k.rank) for k in keys] == [(4, r) for r in range(4)]
    for worker, _ in ranks:
        save(worker, chunk_hashes(worker))
        assert worker.engine.flush(10)
        assert worker.stats.get(SKIPPED) == 0, f"rank {worker.metadata.rank} skipped the remote"


REPLICATED = pytest.mark.parametrize("kind", ["mla", "gqa"])


def test_a_replicated_kv_head_is_keyed_by_the_head_not_the_rank(engine_ranks):
    ranks = engine_ranks("gqa", tp=4, pp=2, head_replicas=2)  # 2 KV heads, 8 ranks
    keys = [worker.engine.chunker.key(b"\x07" * 16) for worker, _ in ranks]
    assert [(k.world_size, k.rank) for k in keys] == [(4, r // 2) for r in range(8)]
    assert len(set(keys)) == 4, "ranks holding one head key apart, or other heads alike"
    assert [w.metadata.worker_rank for w, _ in ranks] == list(range(8))
    assert [w.metadata.writes_shared_tiers for w, _ in ranks] == [True, False] * 4
    disks = {w.engine.storage.lower[0].root.name for w, _ in ranks}
    assert disks == {f"rank{r}of8" for r in range(8)}, "each rank keeps its own disk"


@REPLICATED
def test_rank_1_leaves_the_remote_to_rank_0_and_loads_what_it_wrote(engine_ranks, tmp_path, kind):
    (rank0, _), (rank1, paged1) = engine_ranks(kind, tp=2)
    hashes = chunk_hashes(rank0)
    assert chunk_hashes(rank1) == hashes
    for worker in (rank0, rank1):
        save(worker, hashes)
        assert worker.engine.flush(10)
        assert worker.stats.get(Counter.STORED_CHUNKS) == 3, "a skipped put counted as failed"
    assert len(stored_files(tmp_path / "remote")) == 3, "the remote holds a copy per rank"
    assert (rank0.stats.get(SKIPPED), rank1.stats.get(SKIPPED)) == (0, 3)
    assert rank1.stats.get(tier_counter("fs", TierCounter.PUT_CHUNKS)) == 0
    for worker in (rank0, rank1):  # each rank's own local disk copy
        assert len(stored_files(worker.engine.storage.lower[0].root)) == 3

    rank1.engine.storage.cpu.clear()
    rank1.engine.storage.lower[0].clear()  # rank 1 holds nothing of its own now
    assert [w.engine.lookup_hashes(hashes) for w in (rank0, rank1)] == [3, 3]
    assert load(rank1, hashes) == set()
    assert rank1.stats.get(tier_counter("fs", TierCounter.GET_HITS)) == 3
    assert_same_blocks(paged1, DST, SRC, "rank 1 loading rank 0's chunks from the remote")


@REPLICATED
def test_a_rank_that_keeps_nothing_of_its_own_copies_nothing_out(engine_ranks, monkeypatch, kind):
    (rank0, paged0), (rank1, paged1) = engine_ranks(kind, tp=2, local_cpu=False, local_disk=None)
    copies = {0: 0, 1: 0}
    for rank, (worker, _) in enumerate([(rank0, paged0), (rank1, paged1)]):
        io = worker.engine.paged_io
        gather = io.from_engine

        def counted(*args, rank=rank, gather=gather, **kwargs):
            copies[rank] += 1
            return gather(*args, **kwargs)

        monkeypatch.setattr(io, "from_engine", counted)
    hashes = chunk_hashes(rank0)
    for worker in (rank0, rank1):
        save(worker, hashes)
        assert worker.engine.flush(10)
    assert copies == {0: 3, 1: 0}, "rank 1 copied out chunks only rank 0 writes"
    assert (rank0.stats.get(SKIPPED), rank1.stats.get(SKIPPED)) == (0, 3)
    assert rank1.stats.get(Counter.STORED_CHUNKS) == rank1.stats.get(Counter.STORED_BYTES) == 0
    assert load(rank1, hashes) == set()
    assert_same_blocks(paged1, DST, SRC, "rank 1 loading rank 0's chunks from the remote")


def test_a_chunk_is_a_hit_only_where_every_rank_can_load_it(engine_ranks):
    (rank0, _), (rank1, _) = engine_ranks("mla", tp=2, remote_url=None, local_disk=None)
    hashes = chunk_hashes(rank0)
    save(rank0, hashes)
    assert [w.engine.lookup_hashes(hashes) for w in (rank0, rank1)] == [3, 0]


def test_each_rank_reports_its_kv_events_under_its_own_rank(engine_ranks):
    ranks = engine_ranks("mla", tp=2, remote_url=None, local_disk=None)
    for worker, _ in ranks:
        save(worker, chunk_hashes(worker))
    reported = [worker.take_events() for worker, _ in ranks]
    assert [{r.rank for r in events.get_all_events()} for events in reported] == [{0}, {1}]


@pytest.mark.parametrize(
    ("tp", "dcp", "pcp", "replicas"),
    [(4, 1, 1, 4), (1, 1, 1, 1), (4, 2, 1, 1), (4, 1, 2, 1)],
    ids=["tp4", "tp1", "dcp2", "pcp2"],
)
def test_tp_ranks_replicate_the_latent_unless_context_parallelism_splits_it(tp, dcp, pcp, replicas):
    parallel = SimpleNamespace(
        tensor_parallel_size=tp,
        decode_context_parallel_size=dcp,
        prefill_context_parallel_size=pcp,
    )
    assert facts.latent_replicas(SimpleNamespace(parallel_config=parallel)) == replicas


def test_replicated_metadata_names_the_stage_and_keeps_the_worker_rank():
    metadata = EngineMetadata("m", world_size=6, rank=5).replicated(2)
    assert (metadata.world_size, metadata.rank, metadata.replicas, metadata.replica) == (3, 2, 2, 1)
    assert (metadata.worker_rank, metadata.worker_count) == (5, 6)
    assert not metadata.writes_shared_tiers
    assert EngineMetadata("m", 2, 1).replicated(1) == EngineMetadata("m", 2, 1)
    with pytest.raises(ValueError, match="world_size=6"):
        EngineMetadata("m", world_size=6, rank=5).replicated(4)


def vllm_config(tp, kv_heads, *, dcp=1, pcp=1, layer_heads=(), draft=None):
    """A duck-typed vLLM config: ``layer_heads`` per-layer KV head overrides, ``draft`` a
    draft model's (KV heads, tensor-parallel size)."""

    def model(heads, overrides=None):
        arch = SimpleNamespace(per_layer_overrides=overrides)
        return SimpleNamespace(get_total_num_kv_heads=lambda: heads, model_arch_config=arch)

    overrides = [{"total_num_kv_heads": h} for h in layer_heads] or None
    speculative = None
    if draft is not None:
        speculative = SimpleNamespace(
            draft_model_config=model(draft[0]), draft_tensor_parallel_size=draft[1]
        )
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp,
            decode_context_parallel_size=dcp,
            prefill_context_parallel_size=pcp,
        ),
        model_config=model(kv_heads, overrides),
        speculative_config=speculative,
    )


@pytest.mark.parametrize(
    ("config", "replicas"),
    [
        (vllm_config(2, 1), 2),
        (vllm_config(8, 2), 4),
        (vllm_config(2, 2), 1),
        (vllm_config(2, 8), 1),
        (vllm_config(1, 1), 1),
        (vllm_config(4, 1, dcp=2), 1),
        (vllm_config(4, 1, pcp=2), 1),
        (vllm_config(4, 1, layer_heads=(1, 1)), 4),
        (vllm_config(4, 1, layer_heads=(1, 4)), 1),
        (vllm_config(4, 1, draft=(1, 4)), 4),
        (vllm_config(4, 1, draft=(2, 4)), 1),
        (vllm_config(4, 1, draft=(1, 1)), 1),
        (SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2)), 1),
    ],
    ids=[
        "tp2-kv1",
        "tp8-kv2",
        "kv-eq-tp",
        "kv-gt-tp",
        "tp1",
        "dcp2",
        "pcp2",
        "layers-alike",
        "layers-differ",
        "draft-alike",
        "draft-other-heads",
        "draft-other-tp",
        "heads-unknown",
    ],
)
def test_tp_ranks_replicate_a_kv_head_only_where_every_layer_gives_it_the_same_ranks(
    config, replicas
):
    assert facts.kv_head_replicas(config) == replicas
