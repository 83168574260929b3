"""GEM environments as envhub envs: ``gem/<category>.<Name>[-<variant>]-v<N>``.

GEM's id ``game:Sudoku-v0-easy`` becomes ``gem/game.Sudoku-easy-v0`` and ``math:GSM8K``
becomes ``gem/math.GSM8K-v0``. Its games play offline as they are. Its math, code, logic, QA
and eval envs read a Hugging Face dataset, which envhub does not download: give them
``dataset=`` (a JSONL path or a list of dicts with the env's question and answer fields, e.g.
``problem``/``answer`` for math, ``problem``/``tests`` for code) and, as for every envhub task
env (``envs/datasets.py``), ``split=``/``eval_fraction=``. GEM's ``rg:*`` ids are left out:
the reasoning-gym adapter serves those datasets directly; so are the ids GEM registers but
cannot build (``_UNBUILDABLE``).

Mapping to the TextEnv contract: observations are GEM's, framed as GEM's own observation
wrappers frame them: its ``info["prefix"]`` before and its ``info["suffix"]`` (the board,
"Enter your move.") after, on the reset as on every step; GEM's rewards pass through unchanged;
``success`` is GEM's own verdict (``_succeeded``): a right answer in its one-answer envs, a win
its games announce (not a final reward of 1: most games pay theirs move by move); a GEM format
error (its -0.1 reward) is ``invalid_action``. GEM's turn limits are rules its prompts state,
so running out ends the episode as ``terminated`` (and is no success). ``tools=("python",)``
wraps the env in GEM's own ``ToolEnvWrapper`` with its Python tool, published as an envhub tool
schema (``envhub.adapters.gem_tools``); code runs in an envhub sandbox (``sandbox=`` names the
backend, ``local`` by default). GEM's code envs grade a solution by running it on each test
input; the adapter runs those in an envhub ``local`` sandbox too, instead of GEM's runner
(whose default runs model code unisolated).

Determinism: each reset draws a seed from the env's RNG and passes it to GEM, which seeds
Python's and NumPy's global RNGs with it. Each env keeps its own copy of both global streams
(``envhub.adapters.global_rng``): every call into GEM that may draw holds one process-wide lock
and runs on that env's streams, and the caller's are restored after. So an episode is fixed by
the reset seed even when other GEM or TextArena envs play in the same process, in the same
thread or others (the trainer's ``LocalEnvSource``). GEM 0.1.0's dataset envs (math, code, QA,
logic, eval) draw only in their reset, so their steps (grading, code runs in a sandbox) run
outside the lock and do not wait on one another; a game's steps, which draw, hold it.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from envhub.adapters import did_you_mean, require
from envhub.adapters.catalog import register_source
from envhub.adapters.gem_tools import GemTools, sandboxed_run_python
from envhub.adapters.global_rng import GlobalRNG
from envhub.core import TextEnv, Turn
from envhub.errors import ActionParseError, SourceConfigError, SourceError
from envs.datasets import Split, TaskSet, as_taskset

__all__ = ["GemEnv", "envhub_id", "register"]

SOURCE = "gem"
_GEM_ID = re.compile(
    r"^(?P<category>[a-z]+):(?P<name>[A-Za-z0-9][A-Za-z0-9_.]*?)(?:-v(?P<version>\d+))?"
    r"(?P<suffix>-[A-Za-z0-9_.-]+)?$"
)
_FORMAT_ERROR_REWARD = -0.1  # gem.utils.constants.LanguageGameReward.format_error_reward
_WIN = "Congratulations!"  # how every game of gem-llm 0.1.0 (the pinned version) announces a win
_TERMINAL_STATE = "<｜TERMINAL_STATE｜>"  # gem.utils.constants.TERMINAL_STATE
_UNBUILDABLE = {
    # gem-llm 0.1.0 registers these with options its own games reject, whatever the seed
    "game:Crosswords-v0-random": "its hardcore=None matches none of its words, a ValueError",
    "game:FifteenPuzzle-v0-random": "its num_rows=None is squared before one is drawn, a TypeError",
}
"""GEM ids left out of the catalog: each fails to build in GEM itself, and why."""


def envhub_id(gem_id: str) -> str | None:
    """``game:Sudoku-v0-easy`` -> ``gem/game.Sudoku-easy-v0`` (``None`` if not of that shape)."""
    match = _GEM_ID.match(gem_id)
    if match is None:
        return None
    suffix = match["suffix"] or ""
    return f"gem/{match['category']}.{match['name']}{suffix}-v{match['version'] or 0}"


class GemEnv(TextEnv):
    """One GEM env (module docstring)."""

    out_of_turns: ClassVar[Any] = "terminated"

    def __init__(
        self,
        *,
        env: str,
        dataset: str | TaskSet | Iterable[Mapping[str, Any]] | None = None,
        split: Split = "all",
        eval_fraction: float = 0.0,
        tools: Sequence[str] = (),
        sandbox: str = "local",
        gem_kwargs: dict[str, Any] | None = None,
        max_turns: int | None = 100,
        render_mode: Any = None,
    ) -> None:
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        registry = require(SOURCE, "gem.envs.registration").ENV_REGISTRY
        if env not in registry:
            raise SourceConfigError(
                f"GEM has no env {env!r}.{did_you_mean(env, registry)} "
                "`envhub list --source gem` lists them"
            )
        if env in _UNBUILDABLE:
            family = env.rsplit("-", 1)[0] + "-"  # game:Crosswords-v0-
            others = [str(envhub_id(name)) for name in registry if name.startswith(family)]
            raise SourceConfigError(
                f"GEM {env} cannot be built (a gem-llm 0.1.0 bug: {_UNBUILDABLE[env]}); play "
                f"another variant: {', '.join(sorted(set(others) - {envhub_id(env)}))}"
            )
        self.env, self.gem_kwargs = env, dict(gem_kwargs or {})
        spec = registry[env]
        self._rows: list[dict[str, Any]] | None = None
        if "dataset_name" in spec.kwargs:
            fields = _dataset_fields(_entry_class(env, spec.entry_point), spec.kwargs)
            if dataset is None:
                raise SourceConfigError(
                    f"GEM {env} reads {spec.kwargs['dataset_name']!r} from the Hugging Face Hub, "
                    f"which envhub does not download; pass dataset=PATH.jsonl (or a list of dicts) "
                    f"with the fields {list(fields)}"
                )
            tasks = as_taskset(
                dataset,
                default=(),
                split=split,
                eval_fraction=eval_fraction,
                required=fields,
                name=f"gem/{env}",
            )
            self._rows = list(tasks)
        elif dataset is not None:
            raise SourceConfigError(f"GEM {env} generates its own episodes and takes no dataset")
        self.gem_tools = GemTools(tools, sandbox=sandbox) if tools else None
        self.tools = list(self.gem_tools.schemas) if self.gem_tools else []
        self._source: Any = None
        self._tool: Any = None
        self._globals = GlobalRNG()  # GEM's draws from random, this env's own (docstring)

    # ----------------------------------------------------------------- TextEnv
    def on_reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        seed = int(self.np_random.integers(2**31))
        self._globals.seed(seed)
        with self._globals.active():
            if self._source is None:
                self._source = self._build()
            try:
                observation, info = self._source.reset(seed=seed)
            except Exception as error:
                raise SourceError(
                    f"GEM {self.env} failed to start an episode ({type(error).__name__}: {error})"
                ) from error
        return _framed(str(observation), info), {"gem_env": self.env}

    def on_step(self, action: str) -> Turn:
        call_id = None
        if self.gem_tools is not None:
            try:
                action, call_id = self.gem_tools.translate(action)
            except ActionParseError as error:
                return self.invalid_action(error.feedback)
        try:
            with self._globals.active() if self._rows is None else contextlib.nullcontext():
                observation, reward, terminated, truncated, info = self._source.step(action)
        except Exception as error:
            raise SourceError(
                f"GEM {self.env} raised {type(error).__name__}: {error}; the episode cannot go on "
                "(reset to start another)"
            ) from error
        reward, done = float(reward), bool(terminated or truncated)
        text = str(observation)
        success = _succeeded(text, reward, bool(terminated), bool(truncated), info)
        if text == _TERMINAL_STATE:
            text = "Correct." if success else f"Not correct (reward {reward:g})."
        elif not done:
            text = _framed(text, info)
        return Turn(
            GemTools.answer(text, call_id) if call_id is not None else text,
            reward=reward,
            terminated=done,
            success=success,
            invalid_action=reward == _FORMAT_ERROR_REWARD,
            info=_plain(info),
        )

    def sample_action(self, np_random: np.random.Generator) -> str:
        if np_random.random() < 0.2 or self._source is None:
            return "I am not sure."
        try:
            with self._globals.active():
                return str(self._source.sample_random_action())
        except (NotImplementedError, AttributeError):
            return "\\boxed{42}"

    def on_close(self) -> None:
        if self._source is not None and hasattr(self._source, "close"):
            self._source.close()
        if self._tool is not None:
            self._tool.close()
        self._source = self._tool = None

    def __getstate__(self) -> dict[str, Any]:
        # GEM envs may hold process pools and thread pools; the copy builds its own at reset
        return {**self.__dict__, "_source": None, "_tool": None}

    # ----------------------------------------------------------------- helpers
    def _build(self) -> Any:
        spec = require(SOURCE, "gem.envs.registration").ENV_REGISTRY[self.env]
        kwargs = {**spec.kwargs, **self.gem_kwargs}
        if self._rows is not None:
            kwargs["dataset"] = require(SOURCE, "datasets").Dataset.from_list(self._rows)
        cls = _entry_class(self.env, spec.entry_point)
        if cls.__module__ == "gem.envs.code_env":  # grade in an envhub sandbox, not unisolated
            setattr(sys.modules[cls.__module__], "run_python", sandboxed_run_python)  # noqa: B010
        try:
            source = cls(**kwargs)
        except Exception as error:  # the env's own failure (a missing NLTK corpus, a bad kwarg)
            raise SourceError(
                f"GEM {self.env} cannot be built here ({type(error).__name__}: "
                f"{' '.join(str(error).split())[:300]}); envs that need NLTK corpora need them "
                "downloaded first"
            ) from error
        if self.gem_tools is None:
            return source
        wrapped, self._tool = self.gem_tools.wrap(source)
        return wrapped


def _succeeded(
    observation: str, reward: float, terminated: bool, truncated: bool, info: Any
) -> bool:
    """Whether the GEM step that returned these ended its episode in a success, by GEM's account.

    GEM's one-answer envs (math, QA, code, ...) answer with its terminal-state marker, flagged
    both terminated and truncated; math and QA say ``correct`` in ``info``, the others pay 1 for
    a right answer. GEM's games have no flag; each announces a win in its text, on a step
    flagged terminated and not truncated (running out of turns sets both). Rewards cannot tell:
    most games pay 1 in all over a won episode, a part per right move (Sudoku 1/empty cells per
    cell), so the winning step pays little; and a Minesweeper player who has revealed every safe
    cell has been paid 1 whether or not the next move hits a mine.
    """
    if observation == _TERMINAL_STATE:
        if isinstance(info, dict) and "correct" in info:
            return bool(info["correct"])
        return reward >= 1.0
    return terminated and not truncated and observation.startswith(_WIN)


def _framed(observation: str, info: Any) -> str:
    """``observation`` with GEM's ``info["prefix"]`` before it and ``info["suffix"]`` after it
    (what GEM's observation wrappers show), on lines of their own."""
    if not isinstance(info, dict):
        return observation
    prefix, suffix = info.get("prefix"), info.get("suffix")
    parts = [str(prefix) if prefix else "", observation, str(suffix) if suffix else ""]
    return "\n".join(part for part in parts if part)


def _entry_class(env: str, entry_point: Any) -> Any:
    if not isinstance(entry_point, str):
        return entry_point
    module_name, _, attr = entry_point.partition(":")
    try:
        return getattr(require(SOURCE, module_name), attr)
    except (SyntaxError, AttributeError) as error:
        raise SourceError(f"GEM {env}'s module {module_name} does not import ({error})") from error


def _dataset_fields(cls: Any, kwargs: dict[str, Any]) -> tuple[str, ...]:
    """The record fields a dataset env reads (its question and answer/test keys)."""
    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(cls.__init__).parameters.items()
        if isinstance(parameter.default, str)
    }
    keys = ("question_key", "answer_key", "test_key")
    return tuple(
        str(kwargs.get(key, defaults[key]))
        for key in keys
        if key in defaults and (key != "answer_key" or "test_key" not in defaults)
    )


def _plain(info: Any) -> dict[str, Any]:
    """GEM's step info without values that could not cross a network."""
    if not isinstance(info, dict):
        return {}
    return {
        str(key): value
        for key, value in info.items()
        if isinstance(value, (str, int, float, bool)) or value is None
    }


def _catalog() -> list[dict[str, Any]]:
    registry = require(SOURCE, "gem.envs.registration").ENV_REGISTRY
    entries = []
    for gem_id, spec in registry.items():
        env_id = envhub_id(gem_id)
        if env_id is None or gem_id.startswith("rg:") or gem_id in _UNBUILDABLE:
            continue
        needs = " (needs dataset=)" if "dataset_name" in spec.kwargs else ""
        entries.append(
            {"id": env_id, "kwargs": {"env": gem_id}, "description": f"GEM {gem_id}{needs}."}
        )
    return sorted(entries, key=lambda entry: entry["id"])


def register() -> None:
    """The ``envhub.envs`` entry point: one id per GEM env (its ``rg:*`` copies and the
    ``_UNBUILDABLE`` ids left out)."""
    register_source(SOURCE, "envhub.adapters.gem:GemEnv", _catalog)
