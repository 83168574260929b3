"""``reward``: workers that score finished episodes with verifiers, user functions and judges.

Each worker compiles the ``env.rewards`` specs once. ``score(episode)`` runs every scorer
whose ``domain`` matches the episode's env id and returns the weighted sum, and whether it
replaces the env's return or adds to it. Judges (``kind: judge``) load their model from
``model_path`` into an ``HFEngine`` on the worker.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from trainer.controller.cluster import Cluster, remote
from trainer.controller.dispatch import Dispatch, register
from trainer.controller.worker import Worker, WorkerContext
from trainer.errors import RewardError
from trainer.rewards.verifiers import EpisodeView, make_scorer

__all__ = ["RewardCluster", "RewardWorker", "domain_matches"]


def domain_matches(domain: str, env_id: str) -> bool:
    """``*`` matches all; ``games`` matches ``games/...``; globs and exact ids match as usual."""
    return (
        domain in ("*", env_id)
        or env_id.startswith(domain.rstrip("/") + "/")
        or fnmatch.fnmatch(env_id, domain)
    )


def _judge_scorer(spec: dict[str, Any]) -> Any:
    from trainer.models import load_policy
    from trainer.rewards.judge import DEFAULT_PROMPT, LLMJudge
    from trainer.strategies.hf_engine import HFEngine
    from trainer.strategies.model_eos import model_eos_ids

    if not spec.get("model_path"):
        raise RewardError("a judge reward needs model_path (a local chat model folder)")
    model, tokenizer = load_policy(str(spec["model_path"]))
    engine = HFEngine(  # stops where the model's generation config says, as a served one
        model,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        stop_token_ids=model_eos_ids(str(spec["model_path"])),
    )
    judge = LLMJudge(
        engine,
        tokenizer,
        prompt=str(spec.get("prompt", DEFAULT_PROMPT)),
        max_new_tokens=int(spec.get("max_new_tokens", 8)),
    )
    return lambda episode: judge.grade(engine.generate_batch([judge.request(episode)])[0].token_ids)


class RewardWorker(Worker):
    """One rank of the reward role."""

    def __init__(
        self, ctx: WorkerContext, config: Any = None, *, specs: list[dict[str, Any]]
    ) -> None:
        super().__init__(ctx, config)
        self.routes = []
        for i, spec in enumerate(specs):
            mode = spec.get("mode", "add")
            if mode not in ("add", "replace"):
                raise RewardError(f"env.rewards[{i}].mode is {mode!r}; use 'add' or 'replace'")
            scorer = _judge_scorer(spec) if spec.get("kind") == "judge" else make_scorer(spec)
            self.routes.append(
                (str(spec.get("domain", "*")), float(spec.get("weight", 1.0)), mode, scorer)
            )

    @register(Dispatch.RANK_ZERO)
    def score(self, episode: EpisodeView) -> dict[str, Any]:
        total, replace, parts = 0.0, False, []
        for domain, weight, mode, scorer in self.routes:
            if domain_matches(domain, episode.env_id):
                value = weight * float(scorer(episode))
                total, replace = total + value, replace or mode == "replace"
                parts.append(value)
        return {"score": total, "replace": replace, "matched": len(parts)}


class RewardCluster(Cluster):
    """Typed calls to the ``reward`` workers."""

    worker_cls = RewardWorker

    score_async = remote(RewardWorker.score, future=True)
