"""The rollout scheduler (every ``rollout.mode``) trains on step 1's planned tasks, exactly.

A deterministic engine (its answer depends only on the prompt and on how often that prompt
was asked before) plays step 1's groups twice: through ``run_episodes(plan_groups(1, ...))``
(the evaluation path) and through ``Rollouts.next_batch`` (the pipeline's training batches),
where groups finish in another order than they started. Row by row - after sorting both
batches the same way - the training tensors and the GRPO advantages must be identical:
same tasks, same group ids, rewards, masks and sampling log-probs on the same tokens.
"""

from __future__ import annotations

import asyncio
import collections
import zlib
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import envhub
from trainer.algos.advantages import compute_advantages
from trainer.config import load_config
from trainer.rollout.collate import collate
from trainer.rollout.env_manager import EnvManager, LocalEnvSource, Sampling
from trainer.rollout.groups import plan_groups, run_episodes
from trainer.rollout.rollouts import Rollouts
from trainer.rollout.trajectory import ChatRenderer, Trajectory
from trainer.strategies.base import GenerationRequest, GenerationResult

NUM_GROUPS, GROUP_SIZE = 4, 4


class GuessEnv(envhub.TextEnv):
    """Task ``seed`` lasts ``1 + seed % 3`` turns; each turn's reward is a fixed function of
    the seed and the action text, so equal actions on equal tasks earn equal rewards."""

    def __init__(self) -> None:
        super().__init__(max_turns=10)
        self.seed_value = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[override]
        self.seed_value = int(seed or 0)
        return super().reset(seed=seed, options=options)

    def on_reset(self, options: dict[str, Any]):
        return f"Task {self.seed_value}. Guess.", {}

    def on_step(self, action: str) -> envhub.Turn:
        done = self.turn >= 1 + self.seed_value % 3
        reward = float(zlib.crc32(f"{self.seed_value}:{action}".encode()) % 3) / 2
        return envhub.Turn(f"turn {self.turn}", reward=reward, terminated=done)


class DeterministicEngine:
    """The ``k``-th request with a given prompt always gets the same answer (tokens and
    log-probs); answers are delayed by an amount fixed by the prompt, so concurrent episodes
    finish in a different order than they started."""

    def __init__(self, vocab: list[int], eos: int) -> None:
        self.vocab, self.eos, self.version = vocab, eos, 0
        self.asked: collections.Counter[tuple[int, ...]] = collections.Counter()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        prompt = tuple(request.prompt_ids)
        k = self.asked[prompt]
        self.asked[prompt] += 1
        h = zlib.crc32(repr(prompt).encode())
        await asyncio.sleep((h % 7) / 1000)
        length = min(1 + (h + k) % 3, request.max_new_tokens)
        ids = [self.vocab[(h + 7 * k + 3 * i) % len(self.vocab)] for i in range(length)]
        if (h + k) % 2:
            ids[-1] = self.eos
        return GenerationResult(
            request.request_id,
            ids,
            [-0.1 * (i + 1) - 0.01 * k for i in range(length)],
            "stop" if ids[-1] == self.eos else "length",
            self.version,
        )

    async def abort(self, request_id: str) -> None:
        """Answers come in one piece; nothing to abort."""

    def update_weights(self, weights: Any) -> None:
        self.version += 1

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def get_state(self) -> dict[str, Any]:
        return {"version": self.version}

    def set_state(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])


def engine_for(tokenizer: Any) -> DeterministicEngine:
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special][:40]
    return DeterministicEngine(vocab, tokenizer.eos_token_id)


def by_row(trajectories: list[Trajectory]) -> list[Trajectory]:
    return sorted(trajectories, key=lambda t: (t.group_id, t.token_ids, t.logprobs))


def tensors(trajectories: list[Trajectory], pad: int) -> dict[str, torch.Tensor]:
    batch = collate(trajectories, pad)
    batch["advantages"], _ = compute_advantages(
        "grpo",
        response_mask=batch["response_mask"],
        token_rewards=batch["token_rewards"],
        scores=batch["scores"],
        group_ids=batch["group_ids"],
    )
    return batch


@pytest.mark.parametrize("mode", ["batch", "sync", "async"])
def test_scheduler_batch_equals_the_batch_mode_batch_row_by_row(policy, mode: str) -> None:
    _, tokenizer = policy
    renderer = ChatRenderer(tokenizer)
    # env.id must name a registered env; the source below makes a GuessEnv whatever the id
    cfg = load_config(
        None,
        [
            "env.id=games/guess-number-v0",
            f"env.num_groups={NUM_GROUPS}",
            f"env.group_size={GROUP_SIZE}",
            "seed=3",
            f"rollout.mode={mode}",
            "rollout.max_turns=4",
            "rollout.max_new_tokens=3",
        ],
    )
    source = LocalEnvSource(make=lambda env_id, **kwargs: GuessEnv())
    sampling = Sampling(cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p)

    # batch mode: step 1's plan, played by run_episodes
    batch_engine = engine_for(tokenizer)
    manager = EnvManager(
        batch_engine, renderer, max_turns=cfg.rollout.max_turns, max_context_tokens=1024
    )
    specs = plan_groups(
        1, num_groups=NUM_GROUPS, group_size=GROUP_SIZE, env_ids=cfg.env.ids, seed=cfg.seed
    )
    played, failed = asyncio.run(run_episodes(specs, manager, source, sampling))
    assert not failed and len(played) == NUM_GROUPS * GROUP_SIZE

    # scheduler: the pipeline's Rollouts on a fresh engine of the same kind
    scheduled = Rollouts(cfg, [engine_for(tokenizer)], renderer, source, max_context_tokens=1024)
    try:
        trajectories, failed = scheduled.next_batch()
    finally:
        scheduled.close()
    assert not failed and len(trajectories) == NUM_GROUPS * GROUP_SIZE
    batch_order = list(dict.fromkeys(t.group_id for t in trajectories))
    assert batch_order == sorted({s.group_id for s in specs})  # step 1's groups, in order

    a = tensors(by_row(played), tokenizer.pad_token_id)
    b = tensors(by_row(trajectories), tokenizer.pad_token_id)
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), (
            f"column {name} differs between batch mode and the scheduler"
        )
    # the groups carry signal, so the comparison means something
    assert a["advantages"].abs().sum() > 0

    # the scheduler's own row order (group after group, by group number; within a group, by
    # episode) gives every row the advantage it has in batch mode: group ids define the groups
    rows = tensors(trajectories, tokenizer.pad_token_id)
    order = sorted(
        range(len(trajectories)),
        key=lambda i: (
            trajectories[i].group_id,
            trajectories[i].token_ids,
            trajectories[i].logprobs,
        ),
    )
    assert torch.equal(rows["advantages"][order], a["advantages"])
    for t in trajectories:  # every row's seed is its group's task seed
        assert t.seed == next(s.seed for s in specs if s.group_id == t.group_id)
