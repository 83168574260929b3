"""A small workload for the simulated-engine tests: a real tokenizer, and an env whose task
seed fixes its turns and per-turn token budgets."""

from __future__ import annotations

import asyncio
from typing import Any

import envhub
from trainer.rollout.env_manager import EnvManager, LocalEnvSource
from trainer.rollout.router import EngineRouter
from trainer.rollout.sim_engine import QWEN2_5_7B, SimEngine, StepCost
from trainer.rollout.trajectory import ChatRenderer
from trainer.strategies.base import GenerationRequest, GenerationResult

COST = StepCost.for_model(QWEN2_5_7B)


def budgets(seed: int) -> list[int]:
    """Per-turn token budgets of task ``seed``: 1 to 3 turns of 5 to 40 tokens."""
    return [5 + (seed * 7 + turn * 13) % 36 for turn in range(1 + seed % 3)]


class PlannedEnv(envhub.TextEnv):
    """Accepts any text; ends after ``len(budgets(seed))`` turns, each capped at its budget."""

    def __init__(self) -> None:
        super().__init__(max_turns=10)
        self.plan: list[int] = []

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[override]
        self.plan = budgets(int(seed or 0))
        return super().reset(seed=seed, options=options)

    def on_reset(self, options: dict[str, Any]):
        return "Say anything.", {"max_new_tokens": self.plan[0]}

    def on_step(self, action: str) -> envhub.Turn:
        done = self.turn >= len(self.plan)
        info = {} if done else {"max_new_tokens": self.plan[self.turn]}
        return envhub.Turn("ok", reward=float(self.turn % 2), terminated=done, info=info)


_RENDERER: list[ChatRenderer] = []


def renderer() -> ChatRenderer:
    """A ChatML renderer over a small BPE tokenizer (built once)."""
    if not _RENDERER:
        from trainer.models import build_tokenizer

        texts = ["Say anything.", "ok", "anything at all", "a b c d e f g"] * 20
        _RENDERER.append(ChatRenderer(build_tokenizer(texts, "bpe", max_vocab=300)))
    return _RENDERER[0]


def engines(
    count: int, cost: StepCost = COST, kind: type[SimEngine] = SimEngine, **options: Any
) -> list[Any]:
    r = renderer()
    token = r.encode("a")[0]
    return [
        kind(cost, token_id=token, eos_token_id=r.eos_token_id, **options) for _ in range(count)
    ]


def manager(router: EngineRouter, **options: Any) -> EnvManager:
    return EnvManager(router, renderer(), max_turns=10, max_context_tokens=4096, **options)


def source() -> LocalEnvSource:
    return LocalEnvSource(make=lambda env_id, **kwargs: PlannedEnv())


FAST = StepCost(
    weight_bytes=0,
    flops_per_token=0,
    attention_flops_per_context_token=0,
    kv_bytes_per_token=COST.kv_bytes_per_token,
    step_overhead_s=1e-5,
)
"""Steps of ten simulated microseconds: a real-time loop runs the workload in moments."""


class GateEngine(SimEngine):
    """Sets ``started`` once ``wanted`` requests (over all gates sharing ``seen``) came in."""

    def __init__(
        self, *args: Any, started: asyncio.Event, wanted: int, seen: list[int], **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.started, self.wanted, self.seen = started, wanted, seen

    def start_generate(self, request: GenerationRequest) -> asyncio.Future[GenerationResult]:
        future = super().start_generate(request)
        self.seen[0] += 1
        if self.seen[0] >= self.wanted:
            self.started.set()
        return future


DYING_SEED = 13
"""``PlannedEnv`` in a worker ends the worker's process when stepped on this task seed."""


class _DyingEnv(PlannedEnv):
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[override]
        self.task_seed = int(seed or 0)
        return super().reset(seed=seed, options=options)

    def on_step(self, action: str) -> envhub.Turn:
        if self.task_seed == DYING_SEED:
            import os

            os._exit(3)  # the whole worker process, as a segfaulting env would
        return super().on_step(action)


def worker_setup(
    engine: Any, generate_timeout_s: float | None = None
) -> tuple[EnvManager, LocalEnvSource]:
    """An env worker's manager and envs (``EnvWorkers``' ``setup``: built in the worker; a
    ``functools.partial`` of it passes ``generate_timeout_s``)."""
    manager = EnvManager(
        engine,
        renderer(),
        max_turns=10,
        max_context_tokens=4096,
        generate_timeout_s=generate_timeout_s,
    )
    return manager, LocalEnvSource(make=lambda env_id, **kwargs: _DyingEnv())


def broken_setup(engine: Any) -> tuple[EnvManager, LocalEnvSource]:
    """A setup that fails in the worker (as a missing tokenizer file would)."""
    raise ValueError("no tokenizer here")
