"""reasoning-gym datasets as envhub task envs: ``reasoning-gym/<dataset>-v0``.

Every dataset of reasoning-gym (procedural reasoning tasks with verifiers) is one id. An
episode is one question; the model answers inside ``<answer>...</answer>`` and the
dataset's own ``score_answer`` is the reward (in [0, 1]; 1 is a success); scorers that would
read the answer with ``eval`` or sympy's ``parse_expr`` read it through ``answer_guard``
instead, so an answer is never run as code. The ``retry`` variant
(``reasoning-gym/<dataset>-retry-v0``, ``attempts=3``) is multi-turn: a wrong answer is told
its score and may try again until the attempts run out.

Tasks follow ``envs/datasets.py``: ``reset(options={"task": entry})`` plays that entry,
``{"task_id": "17"}`` / ``{"task_index": i}`` pick one, and otherwise the seed draws one. The
procedural dataset holds ``size`` entries generated from ``dataset_seed`` (reasoning-gym
makes entry ``i`` from the dataset seed and ``i`` alone, so an entry is the same in every
process); ids are the entry's index, and ``split``/``eval_fraction`` split them by the same
hash as ``TaskSet``. ``dataset=`` (a JSONL path or a list of reasoning-gym entries with
``question``, ``answer``, ``metadata``) replaces the procedural entries, scored by the same
dataset's ``score_answer``. ``config={...}`` sets the dataset's own config fields (its
difficulty); unknown fields are refused with the accepted ones named.

Determinism: complete. Entries are generated lazily, so a 500-entry dataset costs nothing
until an episode draws from it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import numpy as np

from envhub.adapters import did_you_mean, require
from envhub.adapters.answer_guard import UnsafeScorer, guard_scorer
from envhub.adapters.catalog import register_source
from envhub.core import TextEnv, Turn
from envhub.errors import ActionParseError, SourceConfigError, SourceError
from envhub.parsing import ActionParser
from envs.datasets import Split, Task, TaskSet, as_taskset, stable_hash

__all__ = ["ProceduralTasks", "ReasoningGymEnv", "register"]

SOURCE = "reasoning-gym"
_FEEDBACK = "Give your final answer inside <answer>...</answer>."
_ANSWER = ActionParser(format="tag", tag="answer", lenient=False)


class ProceduralTasks:
    """The first ``size`` entries of a procedural dataset, selected like a ``TaskSet``.

    Ids are ``"0"`` .. ``str(size - 1)``; ``split`` keeps the ids whose hash (the
    ``TaskSet`` rule: ``stable_hash(split_seed, id) / 2**63 < eval_fraction`` is eval) falls in
    it. Entries are made on demand by ``make_entry(index)``.
    """

    def __init__(
        self,
        make_entry: Any,
        size: int,
        *,
        name: str,
        split: Split = "all",
        eval_fraction: float = 0.0,
        split_seed: int = 0,
    ) -> None:
        if size < 1:
            raise SourceConfigError(f"{name}: size must be >= 1, got {size}")
        self.name = name
        self._make = make_entry
        self.indices = [
            index
            for index in range(size)
            if split == "all"
            or (stable_hash(split_seed, str(index)) / 2**63 < eval_fraction) == (split == "eval")
        ]
        if not self.indices:
            raise SourceConfigError(
                f"{name}: the {split!r} split is empty ({size} entries, eval_fraction="
                f"{eval_fraction}); set eval_fraction or use split='all'"
            )

    def __len__(self) -> int:
        return len(self.indices)

    def entry(self, index: int) -> Task:
        return {**self._make(index), "id": str(index)}

    def select(self, options: Mapping[str, Any], rng: np.random.Generator) -> Task:
        """The task for ``reset(options=...)``: ``task``, ``task_id``, ``task_index``, or drawn."""
        if options.get("task") is not None:
            task = options["task"]
            if not isinstance(task, Mapping) or "question" not in task:
                raise SourceConfigError(
                    f"options['task'] must be a reasoning-gym entry (a dict with 'question', "
                    f"'answer', 'metadata'), got {task!r:.80}"
                )
            return {"id": "custom", "metadata": {}, **task}
        if options.get("task_id") is not None:
            index = int(str(options["task_id"])) if str(options["task_id"]).isdigit() else -1
            if index not in self.indices:
                raise SourceConfigError(
                    f"{self.name} has no task with id {options['task_id']!r} in this split "
                    f"(ids are entry indices, e.g. {self.indices[:5]})"
                )
            return self.entry(index)
        if options.get("task_index") is not None:
            position = options["task_index"]
            if not isinstance(position, int) or not -len(self) <= position < len(self):
                raise SourceConfigError(
                    f"task_index {position!r} is out of range for {len(self)} tasks"
                )
            return self.entry(self.indices[position])
        return self.entry(self.indices[int(rng.integers(len(self.indices)))])


class ReasoningGymEnv(TextEnv):
    """One reasoning-gym dataset: answer the question in ``<answer>`` tags (module docstring)."""

    out_of_turns: ClassVar[Any] = "terminated"

    def __init__(
        self,
        *,
        name: str,
        config: dict[str, Any] | None = None,
        dataset: str | TaskSet | Iterable[Mapping[str, Any]] | None = None,
        split: Split = "all",
        eval_fraction: float = 0.0,
        size: int = 500,
        dataset_seed: int = 0,
        attempts: int = 1,
        system_prompt: str | None = "default",
        invalid_action_penalty: float = 0.0,
        max_turns: int | None = None,
        render_mode: Any = None,
    ) -> None:
        if attempts < 1:
            raise SourceConfigError(f"attempts must be >= 1, got {attempts}")
        super().__init__(max_turns=max(max_turns or 1, attempts), render_mode=render_mode)
        factory = require(SOURCE, "reasoning_gym.factory")
        if name not in factory.DATASETS:
            raise SourceConfigError(
                f"reasoning-gym has no dataset {name!r}.{did_you_mean(name, factory.DATASETS)} "
                "`envhub list --source reasoning-gym` lists them"
            )
        self.name, self.attempts = name, attempts
        self.invalid_action_penalty = invalid_action_penalty
        self._config = _config_fields(name, factory.DATASETS[name][1], dict(config or {}))
        prompts = require(SOURCE, "reasoning_gym.utils").SYSTEM_PROMPTS
        self.system_prompt = prompts.get(system_prompt, system_prompt) if system_prompt else None
        self.source = _Dataset(name, {**self._config, "seed": dataset_seed, "size": size})
        self.source.get()  # a config the dataset refuses fails here, not at the first reset
        if dataset is not None:
            self.tasks: TaskSet | ProceduralTasks = as_taskset(
                dataset,
                default=(),
                split=split,
                eval_fraction=eval_fraction,
                required=("question", "answer"),
                name=f"reasoning-gym/{name}",
            )
        else:
            self.tasks = ProceduralTasks(
                self.source.entry,
                size,
                name=f"reasoning-gym/{name}",
                split=split,
                eval_fraction=eval_fraction,
            )
        self.task: Task = {}

    # ----------------------------------------------------------------- TextEnv
    def on_reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self.task = self.tasks.select(options, self.np_random)
        return str(self.task["question"]), {"task_id": self.task["id"], "dataset": self.name}

    def on_step(self, action: str) -> Turn:
        try:
            answer = _ANSWER.parse(action)
        except ActionParseError:
            return self.invalid_action(f"I found no answer. {_FEEDBACK}")
        score = self.score(answer)
        success = score >= 1.0
        info = {"answer": answer[:500], "score": score}
        if success or self.turn >= self.attempts:
            verdict = "correct" if success else f"not correct (score {score:.2f})"
            return Turn(
                f"Your answer is {verdict}.",
                reward=score,
                terminated=True,
                success=success,
                info={**info, "expected": str(self.task.get("answer"))[:500]},
            )
        left = self.attempts - self.turn
        return Turn(
            f"Your answer is not correct (score {score:.2f}). Try again; {left} attempt(s) "
            f"left. {_FEEDBACK}",
            info=info,
        )

    def score(self, answer: str | None) -> float:
        """The dataset's own ``score_answer`` for the current task, clipped to [0, 1].

        A scorer that raises on an answer it cannot parse (some expect JSON) scores it 0: to
        the model that is a wrong answer, not a broken episode.
        """
        entry = {k: v for k, v in self.task.items() if k != "id"}
        entry.setdefault("metadata", {})
        try:
            score = float(self.source.get().score_answer(answer, entry))
        except Exception:  # noqa: BLE001 - the verifier's failure to parse is a wrong answer
            return 0.0
        return min(1.0, max(0.0, score)) if math.isfinite(score) else 0.0

    def expert_action(self) -> str | None:
        answer = self.task.get("answer")
        if self.done or answer is None or self.score(str(answer)) < 1.0:
            return None  # some datasets accept many answers and store none that scores 1
        return f"<answer>{answer}</answer>"

    def sample_action(self, np_random: np.random.Generator) -> str:
        roll = np_random.random()
        if roll < 0.15:
            return "I am not sure."
        if roll < 0.25:
            return "<answer></answer>"
        return f"Let me think. <answer>{int(np_random.integers(0, 100))}</answer>"


def _config_fields(name: str, config_cls: Any, config: dict[str, Any]) -> dict[str, Any]:
    """``config`` checked against the dataset's config dataclass (``seed``/``size`` are ours)."""
    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
    for key in config:
        if key not in fields:
            raise SourceConfigError(
                f"reasoning-gym/{name}: config has no field {key!r}.{did_you_mean(key, fields)} "
                f"It accepts: {', '.join(fields)} (seed and size are dataset_seed= and size=)"
            )
    return config


class _Dataset:
    """A reasoning-gym dataset built on first use and rebuilt after unpickling (some hold
    lambdas and do not pickle)."""

    def __init__(self, name: str, config: dict[str, Any]) -> None:
        self.name, self.config = name, config
        self._dataset: Any = None

    def get(self) -> Any:
        if self._dataset is None:
            try:
                dataset = require(SOURCE).create_dataset(self.name, **self.config)
            except (AssertionError, ValueError, TypeError) as error:
                raise SourceConfigError(
                    f"reasoning-gym/{self.name}: its config refused {self.config} "
                    f"({type(error).__name__}: {error})"
                ) from error
            try:  # its scorer must not run the model's answer as code (answer_guard)
                guard_scorer(type(dataset))
            except UnsafeScorer as error:
                raise SourceError(f"reasoning-gym/{self.name}: {error}") from None
            self._dataset = dataset
        return self._dataset

    def entry(self, index: int) -> dict[str, Any]:
        return dict(self.get()[index])

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "config": self.config, "_dataset": None}


def _catalog() -> list[dict[str, Any]]:
    factory = require(SOURCE, "reasoning_gym.factory")
    return [
        {
            "id": f"reasoning-gym/{name}-v0",
            "kwargs": {"name": name},
            "max_turns": 1,
            "description": f"reasoning-gym {name}: one question, scored by its score_answer.",
            "variants": {"retry": {"attempts": 3, "max_turns": 3}},
        }
        for name in sorted(factory.DATASETS)
    ]


def register() -> None:
    """The ``envhub.envs`` entry point: one id per reasoning-gym dataset."""
    register_source(SOURCE, "envhub.adapters.reasoning_gym:ReasoningGymEnv", _catalog)
