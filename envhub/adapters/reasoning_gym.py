"""reasoning-gym datasets as envhub task envs: ``reasoning-gym/<dataset>-v0``.

Every dataset of reasoning-gym (procedural reasoning tasks with verifiers) is one id, but those
in ``REFUSED``; ``composite`` mixes datasets named in its config (``config={"datasets":
[{"name": "leg_counting", "weight": 1.0, "config": {}}, ...]}``, as YAML or ``-k config=...``
give it: ``weight`` defaults to 1 and ``config`` to the dataset's defaults). An episode is one
question; the model answers inside ``<answer>...</answer>`` and the dataset's own
``score_answer`` is the reward (in [0, 1]; 1 is a success).

The answer is read as reasoning-gym reads it (``parse="reasoning-gym"``, the default): its own
``reasoning_gym.utils.extract_answer`` takes the last closed ``<answer>...</answer>`` (lower
case; an upper-case or unclosed tag, or none, is no answer: reward 0 and ``invalid_action``,
where countdown, fraction_simplification and puzzle24 would pay 0.01), stripped; a code fence
inside stays part of the answer, as the library scores it. No length limit but the action's own
(100,000 characters, ``action_max_length``): tower_of_hanoi and palindrome_partitioning answer
in thousands of characters. envhub adds one rule, its rule for every env: what the reply writes
inside ``<think>...</think>`` blocks it opens is not read (an answer only mused about there is
no answer). ``parse="lenient"`` reads more, as ``envhub.parsing.ActionParser`` does (tags in
any case, an unclosed tag, code fences and backticks stripped): such replies then score more
than reasoning-gym pays them, so scores no longer compare with its harness or published
numbers.

Scorers that would read the answer with ``eval`` or sympy's ``parse_expr`` read it through
``answer_guard`` instead, so an answer is never run as code. The ``retry`` variant
(``reasoning-gym/<dataset>-retry-v0``, ``attempts=3``) is multi-turn: a wrong answer is told
that it is wrong (not its score, which would guide a search by closeness) and may try again
until the attempts run out. The answer given at attempt ``k`` earns its score divided by ``k``:
many datasets have two or three possible answers (True/False, Yes/No, on/off/undetermined),
which three attempts at full pay would enumerate for a sure 1.0; discounted, trying each in
turn earns 0.6-0.83 (1/2 + 1/4 = 0.75 on a balanced yes/no dataset), against 1.0 for the right
answer at once. With ``attempts=1`` nothing changes.

Reward: the dataset's own score is the default (``reward="score"``), what users of
reasoning-gym expect; but several scorers pay for closeness or format, so a constant answer
earns part of it. Measured over a few hundred tasks each (one constant, or one per question
format): time_intervals 0.78 (``04:00``, ``50 days``, ``30 days, 12:00``), rectangle_count
0.44, knight_swap 0.44, self_reference 0.43, gcd 0.38, polynomial_equations 0.34,
rotten_oranges 0.34. ``reward="success"`` pays 1.0 only for a full-score answer and 0
otherwise: the choice for RL on those datasets.

The scorer runs in a helper process (``answer_guard.ScoringProcess``, one per dataset and
config in a process, 50-150 us a call): an answer whose check takes longer than
``score_time_limit_s`` (default 2 s, wall clock; the slowest reference answers measured,
intermediate_integration's, take 0.13 s, 0.5 s in a cold process) scores 0 and is told so.
``score_time_limit_s=None`` scores in this process without a limit (a platform without
``os.fork``). Scorers that give success to junk are replaced (``answer_guard.SCORE_FIXES``),
and the datasets in ``REFUSED`` are not offered, alone or in a ``composite``.

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
import os
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Literal

import numpy as np

from envhub.adapters import did_you_mean, require
from envhub.adapters.answer_guard import (
    SCORE_FIXES,
    ScoringProcess,
    UnsafeScorer,
    guard_scorer,
)
from envhub.adapters.catalog import register_source
from envhub.core import TextEnv, Turn
from envhub.errors import ActionParseError, SourceConfigError, SourceError
from envhub.parsing import ActionParser, blank_thinking
from envs.datasets import Split, Task, TaskSet, as_taskset, stable_hash

__all__ = ["REFUSED", "ProceduralTasks", "ReasoningGymEnv", "register"]

SOURCE = "reasoning-gym"
REFUSED = {
    "propositional_logic": (
        "its scorer gives 1 to any valid conclusion that is not a tautology, and cannot tell "
        "one from a copied premise: a third of its own reference conclusions restate a premise, "
        "and a quarter of its premise sets contradict themselves (so anything follows)"
    ),
}
"""Datasets whose scorer cannot tell a right answer from junk, and why: not listed, and
refused at make() (alone or in a composite)."""
_SCORING: dict[str, ScoringProcess] = {}
"""One scoring process per dataset and config, shared by its envs in this process (a trainer
makes an env per episode: one process per env would fork it per episode)."""
_FEEDBACK = "Give your final answer inside <answer>...</answer>."
_LENIENT = ActionParser(format="tag", tag="answer", lenient=False, max_length=100_000)
"""``parse="lenient"``'s reader (module docstring); its cap is the action's own limit."""
_COMPOSITE = (
    "config={'datasets': [{'name': 'leg_counting', 'weight': 1.0, 'config': {}}, ...]} (weight "
    "defaults to 1, config to the dataset's defaults)"
)
"""The composite's config format, shown in its errors and its description."""


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
        reward: Literal["score", "success"] = "score",
        parse: Literal["reasoning-gym", "lenient"] = "reasoning-gym",
        score_time_limit_s: float | None = 2.0,
        system_prompt: str | None = "default",
        invalid_action_penalty: float = 0.0,
        max_turns: int | None = None,
        render_mode: Any = None,
    ) -> None:
        if attempts < 1:
            raise SourceConfigError(f"attempts must be >= 1, got {attempts}")
        if reward not in ("score", "success"):
            raise SourceConfigError(
                f"reward must be 'score' (the dataset's own score) or 'success' (1 for a "
                f"full-score answer, else 0), got {reward!r}"
            )
        if parse not in ("reasoning-gym", "lenient"):
            raise SourceConfigError(
                f"parse must be 'reasoning-gym' (read answers as reasoning-gym does) or "
                f"'lenient' (any case, unclosed tags, fences stripped), got {parse!r}"
            )
        if score_time_limit_s is not None and not 0 < score_time_limit_s <= 86_400:
            raise SourceConfigError(
                "score_time_limit_s must be > 0 and at most 86400 (a day), or None (no limit), "
                f"got {score_time_limit_s!r}"
            )
        if score_time_limit_s is not None and not hasattr(os, "fork"):
            raise SourceConfigError(
                "score_time_limit_s needs os.fork, which this platform lacks; pass "
                "score_time_limit_s=None to score in this process without a time limit"
            )
        super().__init__(max_turns=max(max_turns or 1, attempts), render_mode=render_mode)
        factory = require(SOURCE, "reasoning_gym.factory")
        if name not in factory.DATASETS:
            raise SourceConfigError(
                f"reasoning-gym has no dataset {name!r}.{did_you_mean(name, factory.DATASETS)} "
                "`envhub list --source reasoning-gym` lists them"
            )
        self.name, self.attempts = name, attempts
        self.reward = reward
        """``"score"``: the dataset's score; ``"success"``: 1 for a full score, else 0."""
        self.parse = parse
        """How answers are read: ``"reasoning-gym"`` as the library does, or ``"lenient"``."""
        self.invalid_action_penalty = invalid_action_penalty
        self._config = _config_fields(name, factory.DATASETS[name][1], dict(config or {}))
        if name == "composite":
            self._config["datasets"] = _dataset_specs(self._config.get("datasets"))
        prompts = require(SOURCE, "reasoning_gym.utils").SYSTEM_PROMPTS
        self.system_prompt = prompts.get(system_prompt, system_prompt) if system_prompt else None
        self.source = _Dataset(name, {**self._config, "seed": dataset_seed, "size": size})
        self.source.get()  # a config the dataset refuses fails here, not at the first reset
        self.score_time_limit_s = score_time_limit_s
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
        answer = self.read_answer(action)
        if answer is None:
            return self.invalid_action(f"I found no answer. {_FEEDBACK}")
        checked = self._score(answer)
        score = 0.0 if checked is None else checked
        success = score >= 1.0
        info = {"answer": answer[:500], "score": score, "check_timed_out": checked is None}
        if checked is None:
            verdict = f"took too long to check (over {self.score_time_limit_s:g} s), so it scores 0"
        else:
            verdict = "is correct" if success else "is not correct"
        if success or self.turn >= self.attempts:
            earned = float(success) if self.reward == "success" else score
            attempt = self.turn if self.attempts > 1 else 1  # attempt k earns 1/k of it
            return Turn(
                f"Your answer {verdict}.",
                reward=earned / attempt,
                terminated=True,
                success=success,
                info={**info, "expected": str(self.task.get("answer"))[:500]},
            )
        left = self.attempts - self.turn
        return Turn(
            f"Your answer {verdict}. Try again; {left} attempt(s) left. {_FEEDBACK}", info=info
        )

    def read_answer(self, text: str) -> str | None:
        """The answer in the model's ``text`` as ``parse`` reads it, or None if it gave none."""
        text = blank_thinking(text, leading=False)  # thinking is never the answer (docstring)
        if self.parse == "lenient":
            try:
                return _LENIENT.parse(text)
            except ActionParseError:
                return None
        answer = require(SOURCE, "reasoning_gym.utils").extract_answer(text)
        return None if answer is None else str(answer)

    def score(self, answer: str | None) -> float:
        """The dataset's own ``score_answer`` for the current task, clipped to [0, 1]; 0 for
        an answer whose check ran past ``score_time_limit_s``."""
        checked = self._score(answer)
        return 0.0 if checked is None else checked

    def _score(self, answer: str | None) -> float | None:
        """``score``, or None when the check ran out of time.

        A scorer that raises on an answer it cannot parse (some expect JSON) scores it 0: to
        the model that is a wrong answer, not a broken episode.
        """
        entry = {k: v for k, v in self.task.items() if k != "id"}
        entry.setdefault("metadata", {})
        self.source.get()  # built here, where a forked scoring process inherits it
        limit = self.score_time_limit_s
        try:
            if limit is None:
                score: float | None = self.source.score(answer, entry)
            else:
                score = self.source.scoring()(answer, entry, limit)
        except SourceError:  # a task the scoring process cannot receive: the caller's to fix
            raise
        except Exception:  # noqa: BLE001 - the verifier's failure to parse is a wrong answer
            return 0.0
        if score is None:
            return None
        return min(1.0, max(0.0, score)) if math.isfinite(score) else 0.0

    @property
    def scoring(self) -> ScoringProcess | None:
        """The process that runs this dataset's scorer, shared by its envs in this process;
        None with ``score_time_limit_s=None`` (the scorer runs in this process)."""
        return None if self.score_time_limit_s is None else self.source.scoring()

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


def _refuse(name: str) -> None:
    """SourceError naming the reason if ``name`` is in ``REFUSED``."""
    if name in REFUSED:
        raise SourceError(
            f"reasoning-gym/{name} is not offered: {REFUSED[name]}. For logic, use "
            "reasoning-gym/syllogism-v0 or reasoning-gym/knights_knaves-v0"
        )


def _dataset_specs(datasets: Any) -> list[Any]:
    """A composite's ``datasets`` as reasoning-gym's ``DatasetSpec``s, from the plain dicts a
    YAML file or ``-k config=...`` gives (``weight`` 1 and ``config`` {} by default)."""
    spec_cls = require(SOURCE, "reasoning_gym.composite").DatasetSpec
    if not datasets:
        raise SourceConfigError(
            f"reasoning-gym/composite needs the datasets it mixes, {_COMPOSITE}"
        )
    if not isinstance(datasets, list | tuple):
        raise SourceConfigError(
            f"reasoning-gym/composite: datasets must be a list, got {datasets!r:.80}; {_COMPOSITE}"
        )
    specs = []
    for index, item in enumerate(datasets):
        if isinstance(item, spec_cls):
            specs.append(item)
            continue
        where = f"reasoning-gym/composite: datasets[{index}]"
        if not isinstance(item, dict):
            raise SourceConfigError(f"{where} must be a dict, got {item!r:.80}; {_COMPOSITE}")
        for key in item:
            if key not in ("name", "weight", "config"):
                raise SourceConfigError(f"{where} has no field {key!r}; {_COMPOSITE}")
        if not isinstance(item.get("name"), str):
            raise SourceConfigError(f"{where} needs a dataset's name as 'name'; {_COMPOSITE}")
        specs.append(
            spec_cls(
                name=item["name"], weight=item.get("weight", 1.0), config=item.get("config", {})
            )
        )
    return specs


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
        self.key = f"{name}:{sorted(config.items())!r}"
        """Names the dataset and config in ``_SCORING``."""

    def get(self) -> Any:
        if self._dataset is None:
            try:
                dataset = require(SOURCE).create_dataset(self.name, **self.config)
            except SourceError:
                raise
            except Exception as error:  # any failure to build from the config is the config's
                form = f"; {_COMPOSITE}" if self.name == "composite" else ""
                raise SourceConfigError(
                    f"reasoning-gym/{self.name}: its config refused {self.config} "
                    f"({type(error).__name__}: {error}){form}"
                ) from error
            for name, part in _parts(self.name, dataset).items():
                _refuse(name)
                try:  # its scorer must not run the model's answer as code (answer_guard)
                    guard_scorer(type(part))
                except UnsafeScorer as error:
                    raise SourceError(f"reasoning-gym/{self.name}: {error}") from None
            self._dataset = dataset
        return self._dataset

    def scoring(self) -> ScoringProcess:
        """This dataset's ``ScoringProcess`` in ``_SCORING`` (made on first use)."""
        return _SCORING.get(self.key) or _SCORING.setdefault(self.key, ScoringProcess(self.score))

    def score(self, answer: str | None, entry: dict[str, Any]) -> float:
        """The dataset's ``score_answer``, or its fix in ``answer_guard.SCORE_FIXES`` (a
        composite's entry is scored by the dataset it came from)."""
        dataset = self.get()
        name = self.name
        if name == "composite":
            name = str(entry["metadata"].get("source_dataset"))
            dataset = dataset.datasets.get(name, dataset)
        fix = SCORE_FIXES.get(name)
        return float(fix(dataset, answer, entry) if fix else dataset.score_answer(answer, entry))

    def entry(self, index: int) -> dict[str, Any]:
        return dict(self.get()[index])

    def __getstate__(self) -> dict[str, Any]:
        return {**vars(self), "_dataset": None}


def _parts(name: str, dataset: Any) -> dict[str, Any]:
    """The datasets whose scorers score ``dataset``'s entries: the ones a composite mixes (its
    ``score_answer`` hands each entry to one), or ``dataset`` itself."""
    if name == "composite":
        return {"composite": dataset, **getattr(dataset, "datasets", {})}
    return {name: dataset}


def _catalog() -> list[dict[str, Any]]:
    """One entry per dataset but those in ``REFUSED`` (which cannot be made)."""
    factory = require(SOURCE, "reasoning_gym.factory")
    described = {
        "composite": f"reasoning-gym composite: a mix of datasets; needs {_COMPOSITE}.",
    }
    return [
        {
            "id": f"reasoning-gym/{name}-v0",
            "kwargs": {"name": name},
            "max_turns": 1,
            "description": described.get(
                name, f"reasoning-gym {name}: one question, scored by its score_answer."
            ),
            "variants": {"retry": {"attempts": 3, "max_turns": 3}},
        }
        for name in sorted(factory.DATASETS)
        if name not in REFUSED
    ]


def register() -> None:
    """The ``envhub.envs`` entry point: one id per reasoning-gym dataset."""
    register_source(SOURCE, "envhub.adapters.reasoning_gym:ReasoningGymEnv", _catalog)
