"""One episode against one env: observation -> chat template -> tokens -> generate -> step.

``EnvManager.run`` is the per-episode loop the rollout scheduler runs many of at once
(asyncio): each turn it sends the running token ids to the engine (a ``TurnEngine``; in
a run, the ``EngineRouter``), appends the generated ids (policy tokens) unchanged, decodes
them to the action text, steps the env, and appends the tokens of the env's reply (context).
A crashed env ends the episode as ``failed`` (the caller drops or replaces it); it never
raises into the batch. So does an env whose output is malformed (messages that are not chat
messages, a reward that is not a finite float32 number, flags that are not bools, info that is
not a dict) and a reward function that raises or scores NaN (``trainer.rollout.env_output``):
the failure names the env or the reward function and the field, and nothing of it reaches
training. An env reply that would overflow ``max_context_tokens`` ends the episode
``truncated`` without it (no trained row is longer than the context).

Where envs live is an ``EnvSource``:

``LocalEnvSource``  ``envhub.make`` in this process (the default; games step in microseconds);
                    ``threaded=True`` runs every env call in its own daemon thread, so
                    ``EnvManager(step_timeout_s=...)`` bounds even an env whose ``step``
                    blocks (a hung call is abandoned; its thread cannot stall the run or exit).
                    Not an env call that holds the GIL (a C extension, a catastrophic regex):
                    the timeout fires only once it returns, and the event loop stands still
                    meanwhile (in ``EnvWorkers`` too: a stuck worker process is alive, and only
                    a weight update's ``rollout.pause_timeout_s`` ends it). Only process isolation
                    bounds such envs: ``PoolEnvSource``, whose watchdog kills the worker
``PoolEnvSource``   an ``envhub.pool.EnvPool`` of worker processes / Ray actors (crash- and
                    hang-isolated), or a remote ``envhub serve`` through the pool's client
Both hand out ``EnvSession`` objects with async ``reset`` / ``step`` / ``close``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from envhub.model_agent import answer_tool_calls, call_ids
from envhub.pool.host import BadEnvOutputError
from envhub.tool_calls import thinking_spans
from trainer.rollout.env_output import (
    ResetOutcome,
    StepOutcome,
    checked_reset,
    checked_step,
    rendered,
    score_episode,
)
from trainer.rollout.tool_parsers import env_action
from trainer.rollout.trajectory import ChatRenderer, Trajectory
from trainer.rollout.turn_deadline import bounded_generate
from trainer.strategies.base import GenerationRequest, GenerationResult

if TYPE_CHECKING:
    from envhub.pool.pool import Backend as PoolBackend

__all__ = [
    "EnvManager",
    "EnvSession",
    "EnvSource",
    "LocalEnvSource",
    "PoolEnvSource",
    "Sampling",
    "TurnEngine",
    "check_held_out_builds",
    "prompt_context",
]

SampleUnit = Literal["episode", "turn", "auto"]
Context = Literal["full", "last_k_turns", "strip_thinking"]
_log = logging.getLogger(__name__)
_request_ids = itertools.count()


class EnvSession(Protocol):
    """One env instance for one episode at a time (``options``: the env's ``reset`` options)."""

    async def reset(self, seed: int, options: dict[str, Any] | None = None) -> ResetOutcome: ...

    async def step(self, action: str | dict[str, Any]) -> StepOutcome: ...

    async def close(self) -> None: ...


class TurnEngine(Protocol):
    """What an episode needs of an engine: a turn's generation and its abort (the router's
    ``RolloutEngine`` has them, as has an env worker's ``RemoteEngine``)."""

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...

    async def abort(self, request_id: str) -> None: ...


class EnvSource(Protocol):
    """Hands out env sessions for an env id (and cleans up at the end of the run)."""

    async def session(self, env_id: str) -> EnvSession: ...

    async def aclose(self) -> None: ...


class HeldOutEnvSource:
    """The evaluation's envs: those with held-out settings (``env: [{id, eval: {kwargs}}]``) from
    a source of their own, every other env from the training source (not closed here)."""

    def __init__(self, training: EnvSource, held_out: EnvSource, env_ids: set[str]) -> None:
        self.training, self.held_out, self.env_ids = training, held_out, env_ids

    async def session(self, env_id: str) -> EnvSession:
        source = self.held_out if env_id in self.env_ids else self.training
        return await source.session(env_id)

    async def aclose(self) -> None:
        await self.held_out.aclose()


def check_held_out_builds(held_out: dict[str, dict[str, Any]], env_ids: list[str]) -> None:
    """Build (and close) each env with its evaluation kwargs once: a value its constructor
    refuses (a split it lacks, a size out of range) is a ``ConfigError`` at the run's start, not
    at its first evaluation, after the warm start. (Names pass the config's own check already.)
    ``env_ids``: the mix's ids in order, to name the entry (``env.id[i].eval.kwargs``)."""
    import envhub
    from trainer.errors import ConfigError, Problem

    for env_id, kwargs in held_out.items():
        try:
            envhub.make(env_id, **kwargs).close()
        except Exception as error:  # noqa: BLE001 - the env's own refusal, named
            path = f"env.id[{env_ids.index(env_id)}].eval.kwargs"
            why = f"{env_id} cannot be built with {kwargs} ({type(error).__name__}: {error})"
            raise ConfigError([Problem(path, f"{why}; fix the evaluation's kwargs")]) from None


def prompt_context(
    messages: list[dict[str, Any]], context: Context = "full", turns: int = 4
) -> list[dict[str, Any]]:
    """The messages a turn sample is prompted with (``rollout.context``): all of them; the
    opening ones (before the first assistant turn) and the last ``turns`` turns (an assistant
    message and the env's replies to it); or all, earlier assistant turns without thinking."""
    if context == "strip_thinking":
        return [
            {**m, "content": strip_thinking(m.get("content") or "")}
            if m.get("role") == "assistant"
            else m
            for m in messages
        ]
    if context == "last_k_turns":
        starts = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if len(starts) > turns:
            return messages[: starts[0]] + messages[starts[-turns] :]
    return list(messages)


def strip_thinking(text: str) -> str:
    """``text`` without its thinking and the whitespace after it: ``<think>...</think>``
    blocks, and the reasoning before a first ``</think>`` that a generation prompt ending in
    ``<think>`` opened (``envhub.tool_calls.thinking_spans``, its rules; linear, where the
    regex ``<think>.*?</think>\\s*`` it replaced is quadratic on a repeated unclosed tag)."""
    out, at = [], 0
    for start, end in thinking_spans(text):
        out.append(text[at:start])
        at = end
        while at < len(text) and text[at].isspace():
            at += 1
    out.append(text[at:])
    return "".join(out)


async def in_daemon_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a new daemon thread, awaited without blocking the loop.

    Unlike ``asyncio.to_thread`` (the loop's executor, joined at interpreter exit), a call
    that never returns is simply abandoned when the awaiting task is cancelled (e.g. by
    ``asyncio.wait_for``): it holds no pool slot and does not keep the process alive."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # the caller gave up (timeout/cancel)
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def target() -> None:
        try:
            result, error = fn(*args, **kwargs), None
        except BaseException as raised:  # noqa: BLE001 - handed to the awaiting task
            result, error = None, raised
        with contextlib.suppress(RuntimeError):  # the loop closed while the call ran
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(
        target=target, name=f"env-call-{getattr(fn, '__name__', 'fn')}", daemon=True
    ).start()
    return await future


class _LocalSession:
    def __init__(self, env: Any, threaded: bool) -> None:
        self.env, self.threaded = env, threaded

    async def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await in_daemon_thread(fn, *args, **kwargs) if self.threaded else fn(*args, **kwargs)

    async def reset(self, seed: int, options: dict[str, Any] | None = None) -> ResetOutcome:
        return await self._run(self.env.reset, seed=seed, options=options)

    async def step(self, action: str | dict[str, Any]) -> StepOutcome:
        outcome = await self._run(self.env.step, action)
        info = outcome[4] if isinstance(outcome, tuple) and len(outcome) == 5 else None
        if isinstance(info, dict) and info.get("episode_failed"):  # a hub's worker died or hung
            raise RuntimeError(f"remote episode failed: {info.get('failure')}")
        return outcome

    async def close(self) -> None:
        await self._run(self.env.close)


class LocalEnvSource:
    """``envhub.make`` in this process, one env per episode; ``hub=URL`` makes ``RemoteEnv``s
    (an ``envhub serve`` hub) whose blocking calls run in threads. ``threaded=True`` runs local
    envs' calls in threads too, so a step timeout can end an episode whose env blocks."""

    def __init__(
        self,
        env_kwargs: dict[str, Any] | None = None,
        make: Callable[..., Any] | None = None,
        *,
        hub: str | None = None,
        token: str | None = None,
        threaded: bool = False,
        kwargs_by_env: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        import envhub

        self.env_kwargs = dict(env_kwargs or {})
        self.kwargs_by_env = dict(kwargs_by_env or {})
        """Per env id: kwargs over ``env_kwargs`` (a mix's own settings)."""
        self.hub = hub
        self.threaded = threaded or hub is not None
        if hub is not None:
            self.env_kwargs = {"hub": hub, "token": token}
        self._make = make or envhub.make

    async def session(self, env_id: str) -> EnvSession:
        kwargs = {**self.env_kwargs, **self.kwargs_by_env.get(env_id, {})}
        return _LocalSession(self._make(env_id, **kwargs), threaded=self.threaded)

    async def aclose(self) -> None:
        """Local envs are closed by their sessions."""


class _PoolSession:
    def __init__(self, pool: Any) -> None:
        self.pool, self.episode = pool, None

    async def reset(self, seed: int, options: dict[str, Any] | None = None) -> ResetOutcome:
        result = await self.pool.reset(seed=seed, options=options)
        self.episode = result.episode  # a failed reset's episode too: ``close`` frees it
        if result.failed:
            raise RuntimeError(f"env reset failed: {result.reason}: {result.detail}")
        return result.observation, result.info

    async def step(self, action: str | dict[str, Any]) -> StepOutcome:
        result = await self.pool.step(self.episode, action)
        if result.failed:
            raise RuntimeError(f"env step failed: {result.reason}: {result.detail}")
        return result.observation, result.reward, result.terminated, result.truncated, result.info

    async def close(self) -> None:
        if self.episode is not None:
            await self.pool.close_episode(self.episode)


class PoolEnvSource:
    """An ``envhub.pool.EnvPool`` per env id: envs in worker processes (or Ray actors)."""

    def __init__(
        self,
        env_kwargs: dict[str, Any] | None = None,
        *,
        num_workers: int = 2,
        backend: PoolBackend = "process",
        step_timeout_s: float = 30.0,
        kwargs_by_env: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self.env_kwargs = dict(env_kwargs or {})
        self.kwargs_by_env = dict(kwargs_by_env or {})
        self.num_workers, self.backend, self.step_timeout_s = num_workers, backend, step_timeout_s
        self._pools: dict[str, Any] = {}

    async def session(self, env_id: str) -> EnvSession:
        if env_id not in self._pools:
            from envhub.pool import EnvPool

            pool = EnvPool(
                env_id,
                num_workers=self.num_workers,
                backend=self.backend,
                env_kwargs={**self.env_kwargs, **self.kwargs_by_env.get(env_id, {})},
                step_timeout_s=self.step_timeout_s,
            )
            await pool.start()
            self._pools[env_id] = pool
        return _PoolSession(self._pools[env_id])

    async def aclose(self) -> None:
        for pool in self._pools.values():
            await pool.aclose()
        self._pools.clear()


@dataclass(frozen=True)
class Sampling:
    """Per-turn generation settings of an episode."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0


class EnvManager:
    """Runs episodes with one engine and one chat renderer (see the module docstring).

    Request ids are ``"{episode_key}/{turn}"`` so a router can keep an episode on one
    inference worker (prefix-cache reuse; see ``trainer.rollout.router``). An env may cap the
    next turn's generation length with ``info["max_new_tokens"]`` (reset or step info): None
    or a positive int (anything else fails the episode: ``trainer.rollout.env_output``).
    ``step_timeout_s`` bounds every env call that yields to the event loop (hub, pool and
    threaded envs: ``LocalEnvSource(threaded=True)`` for a local env whose ``step`` may block);
    a timeout, an env exception or an engine error ends the episode as ``failed`` with the
    reason, and an aborted generation ends it as ``failed="aborted"``. ``close_session``
    closes a session within the same bound (a hung env is abandoned, not waited for).
    ``generate_timeout_s`` bounds each turn's generation (queueing in the engine included;
    not the time it is held for a weight update: ``trainer.rollout.turn_deadline``): at the
    deadline the request is aborted in the engine, abandoned if the engine does not
    answer that within another ``generate_timeout_s`` (a hung worker), and the episode fails
    with the reason (``rollout.generate_timeout_s``).
    """

    def __init__(
        self,
        engine: TurnEngine,
        renderer: ChatRenderer,
        *,
        max_turns: int,
        max_context_tokens: int,
        on_episode_end: Callable[[Trajectory], Awaitable[None]] | None = None,
        step_timeout_s: float | None = None,
        generate_timeout_s: float | None = None,
        sample_unit: SampleUnit = "auto",
        context: Context = "full",
        context_turns: int = 4,
    ) -> None:
        self.engine = engine
        self.renderer = renderer
        self.context, self.context_turns = context, context_turns
        if sample_unit == "auto" and context != "full":
            sample_unit = "turn"  # a shortened prompt is a prompt of its own
        if sample_unit == "auto":
            sample_unit = "episode" if renderer.append_only else "turn"
            if sample_unit == "turn":
                _log.warning(
                    "rollout.sample_unit auto: the chat template rewrites earlier turns as a "
                    "conversation grows, so every policy turn is trained as its own sample"
                )
        self.sample_unit: SampleUnit = sample_unit
        """``episode``: one appended token sequence per episode; ``turn``: one sample per turn."""
        self.max_turns = max_turns
        self.max_context_tokens = max_context_tokens
        self.on_episode_end = on_episode_end
        self.step_timeout_s = step_timeout_s
        self.generate_timeout_s = generate_timeout_s

    def options(self) -> dict[str, Any]:
        """The keyword arguments that build a manager like this one (``sample_unit`` resolved)
        over another engine and renderer: what ``rollout.env_workers`` give their workers."""
        return {
            "max_turns": self.max_turns,
            "max_context_tokens": self.max_context_tokens,
            "step_timeout_s": self.step_timeout_s,
            "generate_timeout_s": self.generate_timeout_s,
            "sample_unit": self.sample_unit,
            "context": self.context,
            "context_turns": self.context_turns,
        }

    async def run(
        self,
        session: EnvSession,
        env_id: str,
        seed: int,
        sampling: Sampling,
        group_id: int = 0,
        *,
        episode_key: str | None = None,
    ) -> Trajectory:
        """Play one episode to its end (or ``max_turns``/context limit) and score it
        (``on_episode_end``); an env or reward function that crashes or returns what cannot be
        used fails the episode (the reason names it) and never raises here.

        ``episode_key`` (unique per episode; default: a fresh one, forgotten by the engine at
        the episode's end) prefixes the request ids."""
        trajectory = Trajectory(env_id=env_id, seed=seed, group_id=group_id)
        key = episode_key or f"ep{next(_request_ids)}"
        try:
            await self._play_turns(session, trajectory, key, sampling)
        finally:
            forget = getattr(self.engine, "forget", None)
            if episode_key is None and forget is not None:  # (a caller's key is its to forget)
                forget(key)
        return await score_episode(trajectory, self.on_episode_end)

    async def _play_turns(
        self, session: EnvSession, trajectory: Trajectory, key: str, sampling: Sampling
    ) -> None:
        """``run``'s turns: they fill ``trajectory`` and set its end (``failed``, ``truncated``,
        ``terminated``)."""
        env_id = trajectory.env_id
        # env code is anyone's (a registered env, a pool worker, a hub): whatever it raises,
        # the crashed env is data for this episode, not a crash of the run
        try:
            reset = session.reset(trajectory.seed, self.renderer.reset_options)
            messages, info = checked_reset(await self._env_call(reset), env_id)
        except Exception as error:  # noqa: BLE001 - env code may raise any exception
            self._failed(trajectory, "reset", error)
            return
        trajectory.info = dict(info)
        tools = info.get("tools") or None  # the env's tool schemas: rendered natively if possible
        trajectory.messages.extend(messages)
        per_turn = self.sample_unit == "turn"
        if not per_turn:
            prompt = rendered(trajectory, self.renderer.prompt, messages, tools)
            if prompt is None or self._over_context(trajectory, prompt):
                return
            trajectory.append_context(prompt)
            trajectory.prompt_length = len(trajectory.token_ids)
        for turn in range(self.max_turns):
            tokens = trajectory
            if per_turn:  # this turn's own sample, prompted with the conversation so far
                context = prompt_context(trajectory.messages, self.context, self.context_turns)
                prompt = rendered(trajectory, self.renderer.prompt, context, tools)
                if prompt is None:
                    return
                tokens = trajectory.turn_sample(prompt)
            result = await self._generate(trajectory, f"{key}/{turn}", sampling, info, tokens)
            if result is None:  # out of context, aborted, or the engine failed (flags are set)
                return
            structured = bool(trajectory.info.get("structured_actions"))
            action = self._append_turn(trajectory, result, tools, tokens, structured=structured)
            try:
                outcome = checked_step(await self._env_call(session.step(action)), env_id)
            except Exception as error:  # noqa: BLE001 - as for reset: any env error is data
                self._failed(trajectory, "step", error)
                return
            messages, reward, terminated, truncated, info = outcome
            # every call answered, a refused one "Not run" (as in eval and behind the proxy)
            asked, refused = call_ids(trajectory.messages[-1]), bool(info.get("invalid_action"))
            messages = answer_tool_calls(asked, messages, refused=refused)
            trajectory.end_turn(reward)
            if per_turn:
                tokens.end_turn(reward)
                trajectory.samples.append(tokens)
            trajectory.messages.extend(messages)
            trajectory.invalid_actions += int(bool(info.get("invalid_action")))
            trajectory.success, trajectory.step_info = bool(info.get("success")), dict(info)
            if terminated or truncated:
                trajectory.terminated, trajectory.truncated = terminated, truncated
                return
            if per_turn:
                continue
            stopped = self.renderer.ended(result.token_ids)
            continuation = self.renderer.continuation
            ids = rendered(trajectory, continuation, messages, stopped_on_eos=stopped, tools=tools)
            if ids is None:
                return
            if len(trajectory.token_ids) + len(ids) > self.max_context_tokens:
                # the reply does not fit the context: the episode ends without it (it is context
                # after the last policy token, so nothing trained is lost; a row longer than the
                # model's context would not train: absolute positions end, memory runs out)
                trajectory.truncated = True
                return
            trajectory.append_context(ids)
        trajectory.truncated = True

    def _over_context(self, trajectory: Trajectory, prompt: list[int]) -> bool:
        """The first prompt alone overflows ``max_context_tokens``: the episode fails (it could
        hold no policy token; cut, it would be another task)."""
        if len(prompt) <= self.max_context_tokens:
            return False
        trajectory.failed = True
        trajectory.failure = (
            f"env {trajectory.env_id!r} reset: its prompt is {len(prompt)} tokens, over "
            f"max_context_tokens={self.max_context_tokens} (the model's context); shorten the "
            "env's first observation or use a model with a longer context"
        )
        return True

    async def _generate(
        self,
        trajectory: Trajectory,
        request_id: str,
        sampling: Sampling,
        info: dict[str, Any],
        tokens: Trajectory | None = None,
    ) -> GenerationResult | None:
        """The policy's next turn after the ids of ``tokens`` (default: the episode's own);
        None ends the episode: the context is full (``truncated``), the generation was aborted
        or the engine raised (``failed``, with the reason)."""
        tokens = tokens or trajectory
        budget = min(
            sampling.max_new_tokens,
            int(info.get("max_new_tokens") or sampling.max_new_tokens),
            self.max_context_tokens - len(tokens.token_ids),
        )
        if budget <= 0:
            trajectory.truncated = True
            return None
        request = GenerationRequest(
            request_id,
            list(tokens.token_ids),
            budget,
            sampling.temperature,
            sampling.top_p,
            stop_token_ids=self.renderer.stop_token_ids,  # the template's end-of-turn
        )
        try:
            result = await self._bounded_generate(request)
        except Exception as error:  # noqa: BLE001 - an engine error fails this episode only
            trajectory.failed = True
            trajectory.failure = f"engine error {type(error).__name__}: {error}"[:500]
            return None
        if result.finish_reason == "abort":
            trajectory.failed, trajectory.failure = True, "aborted"
            return None
        return result

    async def _bounded_generate(self, request: GenerationRequest) -> GenerationResult:
        """``engine.generate(request)`` within ``generate_timeout_s`` of generation: time the
        turn is held for a weight update does not count (``trainer.rollout.turn_deadline``)."""
        return await bounded_generate(self.engine, request, self.generate_timeout_s)

    def _append_turn(
        self,
        trajectory: Trajectory,
        result: GenerationResult,
        tools: list[dict[str, Any]] | None = None,
        tokens: Trajectory | None = None,
        *,
        structured: bool = False,
    ) -> str | dict[str, Any]:
        """Append the generated tokens (as policy tokens) and the assistant message; the action.

        With native tool calling the message is structured (``content`` + ``tool_calls``, read
        by the model family's parser). An env with ``structured_actions`` gets that message
        itself; others get the calls in envhub's ``<tool_call>`` form. A malformed call reaches
        the env as the raw text, whose parser answers it with feedback and the penalty."""
        tokens = tokens or trajectory  # the episode's sequence, or this turn's own sample
        tokens.append_generation(result)
        trajectory.record_versions(result)
        turn = self.renderer.read_turn(result.token_ids, tools)  # never raises
        message = turn.message()
        trajectory.messages.append(message)
        if structured and turn.error is None and turn.tool_calls:
            return message
        return env_action(turn)

    async def close_session(self, session: EnvSession) -> None:
        """Close ``session``, ignoring errors (a crashed env may fail to close) and giving up
        after ``step_timeout_s`` (a hung env must not hang its episode's replacement)."""
        with contextlib.suppress(Exception):
            await self._env_call(session.close())

    async def _env_call(self, call: Awaitable[Any]) -> Any:
        if self.step_timeout_s is None:
            return await call
        try:
            return await asyncio.wait_for(call, self.step_timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"no answer within {self.step_timeout_s} s (rollout.env_timeout_s)"
            ) from None

    @staticmethod
    def _failed(trajectory: Trajectory, where: str, error: BaseException) -> Trajectory:
        trajectory.failed = True
        if isinstance(error, BadEnvOutputError):  # the message says which env and what it returned
            trajectory.failure = str(error)[:500]
        else:
            raised = f"{type(error).__name__}: {error}"
            trajectory.failure = f"env {trajectory.env_id!r} {where} raised {raised}"[:500]
        return trajectory
