"""What an env (and the reward function) hands an episode, checked before it is used.

``EnvManager.run`` (``trainer.rollout.env_manager``) passes every reset and step output through
``checked_reset`` / ``checked_step``, and every finished episode through ``score_episode``. Env
code is anyone's (a registered env, a pool worker, a hub), and so is a reward function: what
the episode loop cannot use fails the episode with a reason that names the env (or the reward
function) and the field, never an error from deep inside a chat template, and never a NaN in
the advantages later. What is checked:

* messages: a list of chat messages, dicts with a str ``role`` and a ``content`` that is text:
  a string, None (read as ""), or OpenAI's list of content parts, whose text parts are joined
  (``tool_parsers.content_text``: what a chat-API user writes). A part that is not text (an
  image cannot be trained as tokens) is refused, named (``messages[0].content[1]``);
* a step's reward (a finite number that fits float32: training's tensors), flags and info:
  ``envhub.pool.host.step_output_problem``, the env pool's own check;
* ``info["max_new_tokens"]``, the env's cap on the next turn: absent, None or a positive
  integer;
* the episode's return once the reward function (``on_episode_end``) ran: a function that
  raises, or a return that is not a finite float32 number, fails the episode;
* the chat template on the env's messages and tools (``rendered``): one that refuses them
  fails the episode.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Awaitable, Callable
from typing import Any

from envhub.pool.host import FLOAT32_MAX, BadEnvOutputError, step_output_problem
from trainer.rollout.tool_parsers import content_text
from trainer.rollout.trajectory import Trajectory

__all__ = [
    "REWARD_FAILURE",
    "ResetOutcome",
    "StepOutcome",
    "chat_messages",
    "checked_reset",
    "checked_step",
    "rendered",
    "score_episode",
]

ResetOutcome = tuple[list[dict[str, Any]], dict[str, Any]]
StepOutcome = tuple[list[dict[str, Any]], float, bool, bool, dict[str, Any]]
REWARD_FAILURE = "reward function"
"""How the reason of an episode failed by its reward function starts (``groups.failure_hint``)."""

_CHAT = 'an observation must be a list of chat messages ({"role": str, "content": str} dicts)'


def chat_messages(messages: Any) -> tuple[list[dict[str, Any]], str]:
    """``(messages, "")`` with every content a string (copies of the messages whose content was
    None or text parts), or ``([], problem)`` naming the message and field that is wrong."""
    if not isinstance(messages, list):
        return [], f"messages of type {type(messages).__name__}; {_CHAT}"
    out = messages
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return [], f"messages[{i}] of type {type(message).__name__}; {_CHAT}"
        role = message.get("role")
        if not isinstance(role, str):
            return [], f"messages[{i}] with role={role!r:.40}; a message's role must be a string"
        content = message.get("content")
        if isinstance(content, str):
            continue
        try:
            text = content_text(content)
        except TypeError:
            kind = type(content).__name__
            return [], (
                f"messages[{i}].content of type {kind}; content must be a string or a list of "
                'text parts ({"type": "text", "text": ...})'
            )
        except ValueError as error:  # a part that is not text, named by content_text
            return [], f"messages[{i}].{error}"
        if out is messages:
            out = list(messages)
        out[i] = {**message, "content": text}
    return out, ""


def _info_problem(info: Any) -> str:
    if not isinstance(info, dict):
        return f"info of type {type(info).__name__}; info must be a dict"
    cap = info.get("max_new_tokens")
    if cap is None:
        return ""
    if (
        isinstance(cap, bool)
        or not isinstance(cap, numbers.Real)
        or not float(cap).is_integer()
        or cap < 1
    ):
        return (
            f"info['max_new_tokens']={cap!r:.40}; the next turn's token cap must be a positive "
            "integer (or absent)"
        )
    return ""


def checked_reset(output: Any, env_id: str) -> ResetOutcome:
    """``(messages, info)`` of a reset (contents as strings: ``chat_messages``), or
    ``BadEnvOutputError`` naming the env and the field."""
    messages: list[dict[str, Any]] = []
    if not isinstance(output, (tuple, list)) or len(output) != 2:
        problem = f"{type(output).__name__} {output!r:.60}, not (messages, info)"
    else:
        messages, problem = chat_messages(output[0])
        problem = problem or _info_problem(output[1])
    if problem:
        raise BadEnvOutputError(f"env {env_id!r} reset returned {problem}")
    return messages, output[1]


def checked_step(output: Any, env_id: str) -> StepOutcome:
    """``(messages, reward, terminated, truncated, info)`` of a step (contents as strings), or
    ``BadEnvOutputError`` naming the env and the field (a NaN reward would poison the
    advantages; through a pool's JSON a NaN arrives as ``None``)."""
    messages: list[dict[str, Any]] = []
    if not isinstance(output, (tuple, list)) or len(output) != 5:
        problem = f"{type(output).__name__} {output!r:.60}, not a 5-tuple"
    else:
        raw, reward, terminated, truncated, info = output
        messages, problem = chat_messages(raw)
        problem = (
            problem
            or step_output_problem(reward, terminated, truncated, info)
            or _info_problem(info)
        )
    if problem:
        raise BadEnvOutputError(f"env {env_id!r} step returned {problem}")
    _, reward, terminated, truncated, info = output
    return messages, float(reward), bool(terminated), bool(truncated), info


async def score_episode(
    trajectory: Trajectory, hook: Callable[[Trajectory], Awaitable[Any]] | None
) -> Trajectory:
    """Run the reward function ``hook`` (the run's ``env.rewards``) on a finished episode and
    check its return; never raises: a hook that raises, or a return that is not a finite
    number within float32, fails the episode with the reason (nothing of it is trained)."""
    if trajectory.failed:
        return trajectory
    if hook is not None:
        try:
            await hook(trajectory)
        except Exception as error:  # noqa: BLE001 - a user's scorer may raise anything
            trajectory.failed = True
            why = f"{REWARD_FAILURE} raised {type(error).__name__}: {error}"
            trajectory.failure = why[:500]
            return trajectory
    env_return = sum(trajectory.turn_rewards)  # each reward fits; their sum may not
    for who, value in (
        (f"env {trajectory.env_id!r}", env_return),
        (REWARD_FAILURE, trajectory.episode_reward),
    ):
        if not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
            trajectory.failed = True
            trajectory.failure = (
                f"{who} made the episode's return {value!r}; a return must be a finite number "
                "within float32's range (training's tensors)"
            )
            break
    return trajectory


def rendered(
    trajectory: Trajectory, render: Callable[..., list[int]], *args: Any, **kwargs: Any
) -> list[int] | None:
    """``render(*args, **kwargs)``: the chat template on the env's messages and tools (a
    renderer's ``prompt`` or ``continuation``), or None with the episode failed: a template
    that refuses them (or rewrites history, for ``continuation``) cannot make its tokens."""
    try:
        return render(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - a template error is the episode's
        trajectory.failed = True
        trajectory.failure = (
            f"chat template on env {trajectory.env_id!r}'s messages: "
            f"{type(error).__name__}: {error}"
        )[:500]
        return None
