"""HFEngine weight updates are all or nothing: a bad tensor anywhere in an update loads none of
it, and an iterator that fails part-way leaves the engine refusing to generate until a complete
update arrives, so it never serves a mix of two policies under the old version's label."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from trainer.strategies.base import GenerationRequest
from trainer.strategies.hf_engine import HFEngine
from trainer.weights.errors import StaleWeightsError

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture
def engine(policy_dir: Path) -> Any:
    """A fresh engine on its own copy of the tiny policy (the tests change its weights)."""
    engine = HFEngine.from_pretrained(str(policy_dir), seed=0)
    yield engine
    engine.shutdown()


def snapshot(engine: HFEngine) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def greedy(engine: HFEngine) -> list[int]:
    return engine.generate_batch([GenerationRequest("g", PROMPT, 8, temperature=0.0)])[0].token_ids


def noisy(weights: dict[str, Any]) -> dict[str, Any]:
    """Other weights of the same names and shapes."""
    generator = torch.Generator().manual_seed(1)
    return {k: torch.randn(v.shape, generator=generator) for k, v in weights.items()}


def assert_untouched(engine: HFEngine, before: dict[str, Any], output: list[int]) -> None:
    after = snapshot(engine)
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert engine.version == 0 and greedy(engine) == output


@pytest.mark.parametrize("bad", ["wrong shape", "unknown name", "NaN"])
def test_a_bad_tensor_late_in_a_mapping_loads_nothing(engine: HFEngine, bad: str) -> None:
    before, output = snapshot(engine), greedy(engine)
    update = noisy(before)
    last = list(update)[-1]
    error: type[Exception]
    if bad == "wrong shape":
        update[last] = torch.randn(7)
        error, match = ValueError, rf"{last} of shape \(7,\)"
    elif bad == "NaN":
        update[last] = torch.full_like(update[last], float("nan"))
        error, match = ValueError, f"{last}, which has non-finite values"
    else:
        update["model.layers.9.mlp.up_proj.weight"] = torch.zeros(1)
        error, match = KeyError, "model.layers.9.mlp.up_proj.weight"
    with pytest.raises(error, match=match):
        engine.update_weights(update)
    assert_untouched(engine, before, output)


def test_an_iterator_failing_part_way_refuses_generation_until_a_complete_update(
    engine: HFEngine,
) -> None:
    before, output = snapshot(engine), greedy(engine)
    update = noisy(before)
    names = list(update)
    update[names[-1]] = torch.randn(7)  # the earlier tensors are loaded by then
    with pytest.raises(ValueError, match=names[-1]):
        engine.update_weights(iter(update.items()))
    assert engine.version == 0
    with pytest.raises(StaleWeightsError, match="a weight update failed part-way"):
        greedy(engine)

    async def generate() -> Any:
        return await engine.generate(GenerationRequest("a", PROMPT, 4, temperature=0.0))

    with pytest.raises(StaleWeightsError):
        asyncio.run(generate())
    engine.update_weights({names[0]: before[names[0]]})  # a partial update does not heal it
    with pytest.raises(StaleWeightsError):
        greedy(engine)

    engine.update_weights(iter(before.items()))  # every tensor: served again
    assert engine.version == 2 and greedy(engine) == output


def test_an_iterator_failing_before_any_copy_keeps_serving(engine: HFEngine) -> None:
    before, output = snapshot(engine), greedy(engine)
    with pytest.raises(KeyError, match="not.a.weight"):
        engine.update_weights(iter([("not.a.weight", torch.zeros(1))]))
    assert_untouched(engine, before, output)
