"""Dispatch and collect modes, and Batch splitting, without Ray."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.controller.batch import Batch
from trainer.controller.dispatch import (
    Collect,
    Dispatch,
    collect_results,
    dispatch_call,
    method_spec,
    register,
    registered_methods,
)
from trainer.controller.worker import Worker
from trainer.errors import DispatchError


def make_batch(rows: int = 6) -> Batch:
    return Batch(
        {
            "input_ids": np.arange(rows * 3).reshape(rows, 3),
            "rewards": np.arange(rows, dtype=np.float32),
            "prompts": [f"p{i}" for i in range(rows)],
        },
        meta={"step": 7},
    )


def test_split_then_concat_gives_back_the_batch() -> None:
    batch = make_batch(6)
    parts = batch.split(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    assert parts[1]["prompts"] == ["p2", "p3"] and parts[1].meta == {"step": 7}
    assert parts[2]["input_ids"].tolist() == [[12, 13, 14], [15, 16, 17]]
    assert Batch.concat(parts) == batch
    assert [len(p) for p in make_batch(5).split(3, even=False)] == [2, 2, 1]


def test_torch_columns_split_and_concat() -> None:
    torch = pytest.importorskip(
        "torch", reason="torch is not installed (pip install torch==2.13.0)"
    )
    batch = Batch(
        {"response_mask": torch.tensor([[1, 0], [1, 1], [0, 1], [1, 1]]), "ids": [0, 1, 2, 3]}
    )
    parts = batch.split(2)
    assert torch.equal(parts[1]["response_mask"], torch.tensor([[0, 1], [1, 1]]))
    joined = Batch.concat(parts)
    assert joined == batch and isinstance(joined["response_mask"], torch.Tensor)
    assert "response_mask:Tensor(4, 2)" in repr(batch)


def test_balanced_batches_split_into_parts_of_equal_weight() -> None:
    tokens = [40, 3, 38, 5, 36, 2, 35, 4, 6, 3, 1, 2]  # the long episodes come first
    batch = Batch({"tokens": np.array(tokens), "prompts": [f"p{i}" for i in range(12)]})
    contiguous = [int(p["tokens"].sum()) for p in batch.split(2, even=False)]
    balanced = batch.balanced(2, tokens)
    parts = balanced.split(2, even=False)
    loads = [int(p["tokens"].sum()) for p in parts]
    assert contiguous == [124, 51] and abs(loads[0] - loads[1]) <= 4
    assert sorted(balanced["prompts"]) == sorted(batch["prompts"])  # the same rows, reordered
    assert [len(p) for p in parts] == [6, 6]


def test_batch_refuses_what_it_cannot_split() -> None:
    with pytest.raises(DispatchError, match="a batch of 5 rows does not split evenly over 2 ranks"):
        make_batch(5).split(2)
    with pytest.raises(DispatchError, match="column 'x' has 2 rows but the batch has 6"):
        make_batch(6)["x"] = [1, 2]
    with pytest.raises(DispatchError, match="put other values in Batch.meta"):
        Batch({"x": 3})
    with pytest.raises(KeyError, match="batch has no column 'nope'"):
        make_batch()["nope"]


def test_dp_split_gives_each_rank_its_part_and_broadcasts_the_rest() -> None:
    spec = method_spec(_Demo, "train_step")
    calls = dispatch_call(spec, 2, (make_batch(4), 0.5), {"tag": "x"})
    assert [c.rank for c in calls] == [0, 1]
    assert [c.args[0]["prompts"] for c in calls] == [["p0", "p1"], ["p2", "p3"]]
    assert all(c.args[1] == 0.5 and c.kwargs == {"tag": "x"} for c in calls)
    with pytest.raises(
        DispatchError, match="train_step is registered with Dispatch.DP_SPLIT but got no Batch"
    ):
        dispatch_call(spec, 2, ([1, 2],), {})


def test_dp_split_ragged_gives_the_first_ranks_one_row_more() -> None:
    calls = dispatch_call(method_spec(_Demo, "score"), 3, (make_batch(5),), {})
    assert [c.args[0]["prompts"] for c in calls] == [["p0", "p1"], ["p2", "p3"], ["p4"]]
    assert all(c.args[0].meta == {"step": 7} for c in calls)
    assert method_spec(_Demo, "score").collect is Collect.CONCAT  # DP_SPLIT_RAGGED's default
    with pytest.raises(
        DispatchError, match="score is registered with Dispatch.DP_SPLIT_RAGGED but got no Batch"
    ):
        dispatch_call(method_spec(_Demo, "score"), 2, ([1, 2, 3],), {})


def test_one_to_all_and_rank_zero_reach_the_right_ranks() -> None:
    assert [c.rank for c in dispatch_call(method_spec(_Demo, "load"), 3, ("w",), {})] == [0, 1, 2]
    assert [c.rank for c in dispatch_call(method_spec(_Demo, "sample"), 3, (), {})] == [0]


def test_collect_modes() -> None:
    def collect(mode: Collect, results: list) -> object:
        return collect_results(
            register(Dispatch.ONE_TO_ALL, collect=mode)(lambda: 0).__envhub_dispatch__, results
        )

    assert collect(Collect.ALL, [1, 2]) == [1, 2]
    assert collect(Collect.FIRST, [1, 2]) == 1
    assert collect(Collect.NONE, [1, 2]) is None
    assert collect(Collect.CONCAT, [[1], [2, 3]]) == [1, 2, 3]
    assert collect(Collect.MEAN, [{"loss": 1.0, "n": 2}, {"loss": 3.0}]) == {"loss": 2.0, "n": 2.0}
    with pytest.raises(DispatchError, match="Collect.MEAN cannot average 'x'='a' from rank 1"):
        collect(Collect.MEAN, [{"x": 1}, {"x": "a"}])
    with pytest.raises(
        DispatchError, match=r"Collect.CONCAT needs every rank to return a Batch or a list, got"
    ):
        collect(Collect.CONCAT, [1, 2])


class _Demo(Worker):
    @register(Dispatch.DP_SPLIT, collect=Collect.MEAN)
    def train_step(self, batch: Batch, scale: float = 1.0, tag: str = "") -> dict[str, float]:
        return {"n": len(batch)}

    @register(Dispatch.DP_SPLIT_RAGGED)
    def score(self, batch: Batch) -> Batch:
        return batch

    @register(Dispatch.ONE_TO_ALL)
    def load(self, path: str) -> None:
        return None

    @register(Dispatch.RANK_ZERO)
    def sample(self) -> int:
        return 0

    def helper(self) -> None:
        return None


class _Override(_Demo):
    def offload(self) -> None:  # undecorated override keeps Worker.offload's modes
        super().offload()


def test_registration_is_recorded_and_inherited() -> None:
    assert method_spec(_Demo, "train_step").dispatch is Dispatch.DP_SPLIT
    assert method_spec(_Demo, "sample").collect is Collect.FIRST  # RANK_ZERO's default
    assert method_spec(_Override, "offload").collect is Collect.NONE
    assert {"train_step", "load", "sample", "offload", "reload", "node_info"} <= set(
        registered_methods(_Override)
    )
    with pytest.raises(
        DispatchError, match=r"_Demo.helper is not registered for cluster calls; decorate it"
    ):
        method_spec(_Demo, "helper")
    with pytest.raises(DispatchError, match="_Demo has no method 'nothing'"):
        method_spec(_Demo, "nothing")
    with pytest.raises(DispatchError, match="register\\(dispatch=...\\) takes a Dispatch member"):
        register("dp")  # type: ignore[arg-type]
