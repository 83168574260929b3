"""``EnvHost``: the env-side half of a worker, shared by every backend.

A host builds env instances from a factory, keeps one per live episode, and turns each
request into ``(status, body)`` where ``body`` is JSON bytes (see ``envhub.pool.base``).
Process workers run a host in a child process, Ray workers inside an actor, and the
``inline`` backend calls it directly in the caller's event loop. Closed episodes hand their
env back to a small free list, so the next episode skips construction. The host checks what an
env returns (chat messages, a finite reward within float32's range, bool flags, a dict of info)
and, in a worker, the size of each answer: a bad one fails its episode as ``env_error`` and never
reaches the pool.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import traceback
from collections.abc import Callable
from typing import Any

import orjson

from envhub.errors import EpisodeError
from envhub.pool.base import (
    OP_CLOSE,
    OP_PING,
    OP_RESET,
    OP_STEP,
    OP_STEP_MESSAGE,
    STATUS_ENV_ERROR,
    STATUS_OK,
    STATUS_USAGE_ERROR,
    dumps,
)

__all__ = [
    "FLOAT32_MAX",
    "RUNNING_PREFIX",
    "BadEnvOutputError",
    "EnvHost",
    "observation_problem",
    "spec_factory",
    "step_output_problem",
]

_MAX_IDLE = 8
FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: a reward beyond it is ``inf`` in a trainer's tensors (NaN advantages)."""
RUNNING_PREFIX = b'{"terminated":false,"truncated":false'
"""How a step body starts while the episode goes on."""


def spec_factory(env: Any, env_kwargs: dict[str, Any]) -> Callable[[], Any]:
    """A zero-argument env builder from an id (``str``) or an ``EnvSpec`` plus kwargs."""
    from envhub.registry import spec as lookup

    spec = lookup(env) if isinstance(env, str) else env

    def build() -> Any:
        return spec.make(**env_kwargs)

    return build


class BadEnvOutputError(ValueError):
    """An env's ``reset``/``step`` returned a value of the wrong kind (the message names it)."""


_CHAT = (
    'an observation must be a list of chat messages ({"role": str, "content": str} dicts; '
    'content may also be a list of text parts {"type": "text", "text": str})'
)


def _text_parts(content: Any) -> bool:
    """``content`` is OpenAI's list of text parts (a trainer joins them into one string)."""
    return isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    )


def observation_problem(observation: Any) -> str:
    """What is wrong with an observation ("" if nothing): it must be a list of chat messages,
    dicts with a str ``role`` and a str ``content`` (or a list of text parts, as chat APIs
    write it; other keys may come along), as ``TextEnv`` returns it."""
    if not isinstance(observation, list):
        return f"observation of type {type(observation).__name__}; {_CHAT}"
    for i, message in enumerate(observation):
        if not isinstance(message, dict):
            return f"observation[{i}] of type {type(message).__name__}; {_CHAT}"
        if not isinstance(message.get("role"), str):
            return f"observation[{i}] has no str 'role' ({message!r:.60}); {_CHAT}"
        content = message.get("content")
        if not isinstance(content, str) and not _text_parts(content):
            return f"observation[{i}] has no str 'content' ({message!r:.60}); {_CHAT}"
    return ""


def step_output_problem(reward: Any, terminated: Any, truncated: Any, info: Any) -> str:
    """What is wrong with a step's reward, flags and info ("" if nothing): a reward must be a
    finite number (NaN would become JSON ``null`` and poison training) within float32's range
    (a trainer's tensors: ``1e39`` would be ``inf`` there), the flags bools (numpy's too), info a
    dict."""
    if (
        type(reward) in (float, int)
        and -FLOAT32_MAX <= reward <= FLOAT32_MAX  # (False for NaN)
        and type(terminated) is bool
        and type(truncated) is bool
        and type(info) is dict
    ):
        return ""  # the common case, without the ABC checks below (every step comes here)
    if not isinstance(reward, numbers.Real):
        return f"reward={reward!r:.40} ({type(reward).__name__}); a reward must be a number"
    try:
        value = float(reward)
    except OverflowError:  # an int beyond every float
        value = 2 * FLOAT32_MAX
    if not math.isfinite(value):
        return f"reward={reward!r}; a reward must be a finite number"
    if abs(value) > FLOAT32_MAX:
        return (
            f"reward={reward!r:.40}; a reward must fit float32 (|reward| <= {FLOAT32_MAX:.4g}): "
            "training's tensors would hold inf"
        )
    for name, flag in (("terminated", terminated), ("truncated", truncated)):
        numpy_bool = type(flag).__module__ == "numpy" and type(flag).__name__ in ("bool", "bool_")
        if not isinstance(flag, bool) and not numpy_bool:
            return f"{name}={flag!r:.40} ({type(flag).__name__}); it must be a bool"
    if not isinstance(info, dict):
        return f"info of type {type(info).__name__}; info must be a dict"
    return ""


class EnvHost:
    """Many env instances keyed by episode id, driven by ``handle(op, episode, body)``.

    ``isolated``: the host runs in a worker of its own (a process or an actor), so whatever the
    env raises, ``SystemExit`` and ``KeyboardInterrupt`` included, fails only its episode and
    the worker goes on. The ``inline`` backend (the caller's own process) passes False: there a
    ``KeyboardInterrupt`` is the user's Ctrl-C and must reach them. ``max_answer_bytes``: an
    answer longer than this (the pool's ``max_message_bytes``) fails its episode instead of
    crossing to the pool (None: no limit, for the ``inline`` backend, which copies nothing)."""

    def __init__(
        self,
        factory: Callable[[], Any],
        *,
        isolated: bool = True,
        max_answer_bytes: int | None = None,
    ) -> None:
        self.factory = factory
        self.isolated = isolated
        self.max_answer_bytes = max_answer_bytes
        self.envs: dict[int, Any] = {}
        self.idle: list[Any] = []

    def handle(self, op: int, episode: int, body: bytes) -> tuple[int, bytes]:
        """Run one request; never raises (errors become a status and a JSON body)."""
        status, result = self._handle(op, episode, body)
        limit = self.max_answer_bytes
        if limit is not None and len(result) > limit:
            self.discard(episode)
            return STATUS_ENV_ERROR, dumps(
                {
                    "error": "AnswerTooLarge",
                    "message": (
                        f"the env's answer is {len(result)} bytes of JSON, over the pool's "
                        f"max_message_bytes={limit}; return a smaller observation or raise "
                        "EnvPool(max_message_bytes=...)"
                    ),
                }
            )
        return status, result

    def _handle(self, op: int, episode: int, body: bytes) -> tuple[int, bytes]:
        try:
            if op == OP_STEP:
                return self._step(episode, body.decode())
            if op == OP_STEP_MESSAGE:
                return self._step(episode, orjson.loads(body))
            if op == OP_RESET:
                return self._reset(episode, body)
            if op == OP_CLOSE:
                self._close(episode)
                return STATUS_OK, b"null"
            if op == OP_PING:
                return STATUS_OK, b"null"
            return STATUS_USAGE_ERROR, dumps({"error": "BadRequest", "message": f"unknown op {op}"})
        except EpisodeError as exc:
            return STATUS_USAGE_ERROR, dumps({"error": type(exc).__name__, "message": str(exc)})
        except BaseException as exc:
            if not self.isolated and not isinstance(exc, Exception):
                raise
            self.discard(episode)
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            return STATUS_ENV_ERROR, dumps({"error": type(exc).__name__, "message": detail})

    def _step(self, episode: int, action: Any) -> tuple[int, bytes]:
        # terminated/truncated first: a server tells "episode still running" from the
        # prefix ``RUNNING_PREFIX`` without decoding the body.
        env = self.envs.get(episode)
        if env is None:
            return STATUS_USAGE_ERROR, dumps(
                {
                    "error": "ResetNeededError",
                    "message": f"episode {episode} has no env here; reset it first",
                }
            )
        observation, reward, terminated, truncated, info = env.step(action)
        problem = observation_problem(observation) or step_output_problem(
            reward, terminated, truncated, info
        )
        if problem:
            raise BadEnvOutputError(f"{type(env).__name__}.step returned {problem}")
        return STATUS_OK, dumps(
            {
                "terminated": terminated,
                "truncated": truncated,
                "reward": reward,
                "observation": observation,
                "info": info,
            }
        )

    def _reset(self, episode: int, body: bytes) -> tuple[int, bytes]:
        seed, options = orjson.loads(body)
        env = self.envs.get(episode)
        if env is None:
            env = self.idle.pop() if self.idle else self.factory()
            self.envs[episode] = env
        observation, info = env.reset(seed=seed, options=options)
        problem = observation_problem(observation)
        if not problem and not isinstance(info, dict):
            problem = f"info of type {type(info).__name__}; info must be a dict"
        if problem:
            raise BadEnvOutputError(f"{type(env).__name__}.reset returned {problem}")
        return STATUS_OK, dumps({"observation": observation, "info": info})

    def _close(self, episode: int) -> None:
        env = self.envs.pop(episode, None)
        if env is None:
            return
        if len(self.idle) < _MAX_IDLE:
            self.idle.append(env)
        else:
            env.close()

    def discard(self, episode: int) -> None:
        """Close and forget ``episode``'s env (it failed: it is not reused)."""
        env = self.envs.pop(episode, None)
        if env is not None:
            with contextlib.suppress(Exception):  # an env bug must not stop the cleanup
                env.close()

    def close(self) -> None:
        """Close every env this host holds."""
        for env in [*self.envs.values(), *self.idle]:
            with contextlib.suppress(Exception):  # an env bug must not stop the cleanup
                env.close()
        self.envs.clear()
        self.idle.clear()
