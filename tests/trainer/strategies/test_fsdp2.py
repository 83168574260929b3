"""FSDP2 on 2 gloo ranks trains exactly like plain torch on the whole batch, and never deadlocks."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.trainer.strategies import dist_workers as W
from tests.trainer.strategies.ranks import run_ranks


@pytest.fixture(scope="module")
def two_rank_run() -> dict:
    out = run_ranks(W.fsdp2_rank, 2)
    return {key[1:]: value for key, value in out.items() if key[0] == "even"} | {"ragged": out}


def test_sharded_forward_matches_unsharded(two_rank_run: dict) -> None:
    from trainer.strategies.hf import HFTrainStrategy

    reference = HFTrainStrategy(W.tiny_qwen2(), micro_batch_size=4).forward(W.tiny_batch()).logprobs
    sharded = torch.cat([two_rank_run[(0, "logprobs")], two_rank_run[(1, "logprobs")]])
    torch.testing.assert_close(sharded, reference, atol=1e-6, rtol=0)


def test_two_ranks_train_like_one_process_on_the_whole_batch(two_rank_run: dict) -> None:
    from trainer.strategies.hf import HFTrainStrategy

    plain = HFTrainStrategy(W.tiny_qwen2(), lr=1e-2, micro_batch_size=4)
    batch = W.tiny_batch()
    plain_metrics = [plain.train_step(batch, W.nll_loss) for _ in range(2)]
    expected = dict(plain.model.state_dict())
    got = two_rank_run[(0, "weights")]
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=2e-5, rtol=1e-4, msg=name)
    # both ranks gathered the same full weights
    for name, tensor in got.items():
        torch.testing.assert_close(two_rank_run[(1, "weights")][name], tensor, atol=0, rtol=0)
    # the loss fell, and the rank-averaged loss is the whole-batch loss
    fsdp_nll = [
        (two_rank_run[(0, "metrics")][i]["nll"] + two_rank_run[(1, "metrics")][i]["nll"]) / 2
        for i in range(2)
    ]
    assert fsdp_nll[1] < fsdp_nll[0]
    assert fsdp_nll[0] == pytest.approx(plain_metrics[0]["nll"], abs=1e-5)


def test_full_state_dict_lands_on_rank_zero_only(two_rank_run: dict) -> None:
    assert two_rank_run[(0, "state_keys")] == sorted(two_rank_run[(0, "weights")])
    assert two_rank_run[(1, "state_keys")] == []


def test_ragged_split_runs_dummy_micro_batches_and_trains_like_one_process(
    two_rank_run: dict,
) -> None:
    """Rank 0 holds 3 rows, rank 1 one row plus two zero-weighted dummies: no deadlock, and the step
    is plain torch's on the whole 4-row batch (dummies weigh nothing, real rows weigh alike)."""
    from trainer.strategies.hf import HFTrainStrategy

    out = {key[1:]: value for key, value in two_rank_run["ragged"].items() if key[0] == "ragged"}
    assert out[(0, "logprobs")].shape[0] == 3 and out[(1, "logprobs")].shape[0] == 1
    assert out[(1, "metrics")][0]["optimizer_steps"] == 1.0
    plain = HFTrainStrategy(W.tiny_qwen2(), lr=1e-2, micro_batch_size=4)
    batch = W.tiny_batch(rows=4)
    torch.testing.assert_close(
        torch.cat([out[(0, "logprobs")], out[(1, "logprobs")]]),
        plain.forward(batch).logprobs,
        atol=1e-6,
        rtol=0,
    )
    whole = plain.train_step(batch, W.nll_loss)
    # the step's metrics are the whole batch's on every rank, not each rank's own rows'
    assert out[(0, "metrics")][0]["nll"] == pytest.approx(whole["nll"], rel=1e-6)
    assert out[(1, "metrics")][0]["nll"] == pytest.approx(whole["nll"], rel=1e-6)
    for name, tensor in plain.model.state_dict().items():
        torch.testing.assert_close(
            out[(0, "weights")][name], tensor, atol=2e-5, rtol=1e-4, msg=name
        )
        torch.testing.assert_close(
            out[(1, "weights")][name], out[(0, "weights")][name], atol=0, rtol=0, msg=name
        )


def test_a_rank_given_no_rows_runs_a_zero_weight_dummy_and_trains_like_one_process() -> None:
    """An SFT chunk of 1 row on 2 ranks: rank 1 gets 0 rows, yet both ranks finish the step
    and it equals plain torch's on the one real row."""
    from trainer.strategies.hf import HFTrainStrategy

    out = run_ranks(W.fsdp2_empty_rank, 2)
    assert out[(0, "logprobs")].shape == (1, 12) and out[(1, "logprobs")].shape == (0, 12)
    plain = HFTrainStrategy(W.tiny_qwen2(), lr=1e-2, micro_batch_size=1)
    plain.train_step(W.tiny_batch(rows=1), W.nll_loss)
    for name, tensor in plain.model.state_dict().items():
        torch.testing.assert_close(
            out[(0, "weights")][name], tensor, atol=2e-5, rtol=1e-4, msg=name
        )
        torch.testing.assert_close(
            out[(1, "weights")][name], out[(0, "weights")][name], atol=0, rtol=0, msg=name
        )


def test_cpu_offload_on_cpu_is_refused_with_the_fix() -> None:
    from trainer.strategies.parallel_errors import ParallelConfigError

    with pytest.raises(ParallelConfigError, match="cpu_offload=True needs a CUDA device"):
        from trainer.strategies import fsdp2

        fsdp2.FSDP2TrainStrategy(W.tiny_qwen2(), device="cpu", cpu_offload=True)


@pytest.mark.slow  # two spawned ranks, two strategies each: ~1 min on the 2-core VM
@pytest.mark.parametrize("name", ["fsdp2", "megatron"])
def test_a_resumed_sharded_strategy_takes_the_same_next_step(name: str) -> None:
    if name == "megatron":
        pytest.importorskip("megatron.core")
    out = run_ranks(W.resume_rank, 2, name)
    straight, resumed = out[(0, "straight")], out[(0, "resumed")]
    assert straight.keys() == resumed.keys()
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0, msg=key)


@pytest.mark.slow  # two spawned ranks building DTensor meshes: 60-110 s on the loaded 2-core VM
def test_tensor_parallel_2_matches_one_process() -> None:
    """``tensor_parallel_size=2``: each rank holds half of every projection (DTensor), the pair runs
    the union of its rows, and forward, grad norm and the trained weights equal plain torch's."""
    from trainer.strategies.hf import HFTrainStrategy

    out = run_ranks(W.fsdp2_tp_rank, 2, 2)
    plain = HFTrainStrategy(W.tiny_qwen2(), lr=1e-2, micro_batch_size=4)
    batch = W.tiny_batch()
    assert out[(0, "local_rows")] == out[(1, "local_rows")] == 24  # intermediate 48 split in 2
    got = torch.cat([out[(0, "logprobs")], out[(1, "logprobs")]])
    torch.testing.assert_close(got, plain.forward(batch).logprobs, atol=1e-5, rtol=0)
    plain_metrics = [plain.train_step(batch, W.nll_loss) for _ in range(2)]
    for step in range(2):
        assert out[(0, "metrics")][step]["grad_norm"] == pytest.approx(
            plain_metrics[step]["grad_norm"], rel=1e-4
        )
    for name, tensor in plain.model.state_dict().items():
        torch.testing.assert_close(
            out[(0, "weights")][name], tensor, atol=1e-4, rtol=1e-3, msg=name
        )
        assert torch.equal(out[(1, "weights")][name], out[(0, "weights")][name]), name
    # the shared-memory weight sync's pieces of both ranks rebuild exactly the gathered weights
    from trainer.weights.shards import write_piece

    assert out[(0, "specs")] == out[(1, "specs")]
    for name, shape in out[(0, "specs")]:
        full = torch.full(shape, float("nan"))
        for rank in (0, 1):
            for index, piece in out[(rank, "pieces")].get(name, []):
                write_piece(full, index, piece)
        assert torch.equal(full, out[(0, "weights")][name]), name


def test_lora_under_fsdp2_trains_the_adapters_like_one_process_and_folds_shards() -> None:
    from trainer.strategies.hf import HFTrainStrategy
    from trainer.strategies.lora import adapter_state, engine_weights

    out = run_ranks(W.fsdp2_lora_rank, 2)
    plain = HFTrainStrategy(W.lora_model(), lr=1e-2, micro_batch_size=1)
    for _ in range(2):
        plain.train_step(W.tiny_batch(rows=4), W.nll_loss)
    expected = adapter_state(plain.model).tensors
    assert set(out[(0, "adapters")]) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(out[(0, "adapters")][name], tensor, atol=2e-5, rtol=1e-4)
    assert all("lora_" in name for name in out[(0, "trainable")])  # the base is frozen
    untouched = dict(engine_weights(W.tiny_qwen2().state_dict().items()))
    assert set(out[(0, "base")]) == set(untouched)
    for name, tensor in untouched.items():
        torch.testing.assert_close(out[(0, "base")][name], tensor, atol=0, rtol=0, msg=name)
    for rank in (0, 1):
        moved, off = out[(rank, "fold")]
        assert moved < 1e-5 and off < 1e-5  # folding kept the policy; the base now is it
