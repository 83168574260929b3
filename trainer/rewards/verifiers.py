"""Rule-based verifiers and user functions: score a finished episode from its transcript.

Every scorer has the signature ``score(episode: EpisodeView) -> float``. ``EpisodeView``
carries the transcript, the env's reset info (where task-driven envs put the expected
answer) and the env id. ``make_scorer(spec)`` builds one from a config dict:

``{kind: exact, target: KEY}``    1.0 if the final answer equals ``info[KEY]`` (case-insensitive,
                                  stripped), else 0.0
``{kind: numeric, target: KEY, rel_tol: 1e-6}``  1.0 if the last number in the final answer
                                  is within tolerance of ``info[KEY]``
``{kind: function, function: "pkg.module:fn"}``  any importable ``fn(episode) -> float``

The final answer is the last assistant message, read by the games' ``ActionParser``
(``<answer>...</answer>`` if present, else the last line).
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainer.errors import RewardError

__all__ = ["EpisodeView", "Scorer", "exact_match", "final_answer", "make_scorer", "numeric_match"]

_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


@dataclass
class EpisodeView:
    """What a scorer sees of an episode (plain data, so it can cross to a Ray worker)."""

    env_id: str
    messages: list[dict[str, Any]]
    info: dict[str, Any] = field(default_factory=dict)
    success: bool = False


Scorer = Callable[[EpisodeView], float]


def final_answer(episode: EpisodeView) -> str:
    """The last assistant message's action (``<answer>`` content, else its last line), never
    what it wrote while thinking (``ActionParser``); no action: its text outside thinking."""
    from envhub.parsing import ActionParser, blank_thinking

    for message in reversed(episode.messages):
        if message.get("role") == "assistant":
            text = str(message.get("content", ""))
            try:
                return ActionParser().parse(text)
            except ValueError:
                return blank_thinking(text, leading=False).strip()
    return ""


def exact_match(answer: str, target: Any) -> float:
    """1.0 when ``answer`` equals ``target`` after stripping and case-folding, else 0.0."""
    return float(answer.strip().casefold() == str(target).strip().casefold())


def numeric_match(answer: str, target: Any, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> float:
    """1.0 when the last number in ``answer`` is within tolerance of ``target``, else 0.0."""
    numbers = _NUMBER.findall(answer.replace(",", ""))
    if not numbers:
        return 0.0
    try:
        return float(
            math.isclose(float(numbers[-1]), float(target), rel_tol=rel_tol, abs_tol=abs_tol)
        )
    except (TypeError, ValueError):
        return 0.0


def _target(episode: EpisodeView, key: str) -> Any:
    if key not in episode.info:
        raise RewardError(
            f"{episode.env_id}: reward target {key!r} is not in the env's reset info "
            f"(it has {sorted(episode.info)}); set 'target' to one of those keys"
        )
    return episode.info[key]


def load_function(path: str) -> Scorer:
    """Import ``"package.module:function"``."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise RewardError(f"reward function {path!r} must look like 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise RewardError(f"cannot import reward function {path!r}: {error}") from None
    if not callable(fn):
        raise RewardError(f"reward function {path!r} is not callable")
    return fn


def make_scorer(spec: dict[str, Any]) -> Scorer:
    """A scorer from one ``env.rewards`` entry (judges are built by ``judge.make_judge``)."""
    kind = spec.get("kind")
    if kind == "exact":
        key = str(spec.get("target", "answer"))
        return lambda episode: exact_match(final_answer(episode), _target(episode, key))
    if kind == "numeric":
        key, rel_tol = str(spec.get("target", "answer")), float(spec.get("rel_tol", 1e-6))
        return lambda episode: numeric_match(final_answer(episode), _target(episode, key), rel_tol)
    if kind == "function":
        return load_function(str(spec.get("function", "")))
    raise RewardError(
        f"unknown reward kind {kind!r}; use 'exact', 'numeric', 'function' or 'judge'"
    )
