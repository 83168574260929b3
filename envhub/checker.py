"""``check_env``: does an environment keep the ``TextEnv`` contract?

The checker is a list of small ``check_*`` functions, each testing one promise of the
contract (see ``envhub.core``) and failing with a message that names the fix. ``check_env``
runs them all and reports every problem at once::

    report = envhub.check_env(envhub.make("acme/maze-v0"))   # raises EnvCheckError on failure
    report = envhub.check_env(env, raise_on_failure=False)    # or inspect report.failures

``envhub check`` runs ``check_env`` on registered ids in worker processes, each within a time
limit (``envhub.check_workers.check_ids``), and replays one episode of each family in a new
Python process with another ``PYTHONHASHSEED`` (``check_new_process``).

The episodes played are those real use plays, so a bug on any of those paths fails here first:
random actions on the first seeds, on seeds after them and on far seeds (the trainer evaluates
on seeds from 1e9), the env's expert to a win (a path random play rarely reaches; each expert
action must be valid, its episode a success), the same seed on a used env after another seed
and on a fresh env (pools and hubs reuse env objects), and (``envhub check``) in a new process.
Gymnasium's own ``gymnasium.utils.env_checker.check_env`` runs too (``check_gymnasium``).
"""

from __future__ import annotations

import contextlib
import json
import math
import pickle
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

from envhub.core import ChatSpace, TextEnv
from envhub.errors import EnvCheckError, EpisodeError, describe_error

__all__ = [
    "CHECKS",
    "CheckFailed",
    "CheckReport",
    "CheckResult",
    "CheckSkipped",
    "Replay",
    "check_env",
    "describe_error",
    "transcript",
]

MAX_EPISODE_STEPS = 1_000
"""An episode that has not ended after this many steps fails ``check_episode_ends``."""

FAR_SEED_OFFSET = 1_000_000_000
"""``check_more_seeds`` also plays ``seed`` plus this: the trainer's
evaluation seeds start at 1e9 (``trainer.rollout.groups.EVAL_SEED_BASE``), so an env that breaks
on large seeds fails here instead of in every evaluation."""

EXPERT_EPISODES = 20
"""``check_expert_episode`` fails if the expert wins none of this many episodes (from ``seed``,
played while it loses): chance may beat it (slippery ice wins 1 in 5), but it must win some."""

MORE_SEED_OFFSETS = (2, FAR_SEED_OFFSET)
"""The seeds (after ``seed``) of the random episodes ``check_more_seeds`` plays; the earlier
checks play ``seed`` and ``seed + 1``."""

Replay = Callable[[int], str]
"""Plays ``seed`` in a new Python process and returns the episode as JSON (``transcript``);
raises ``CheckSkipped`` when that process cannot build the env."""


class CheckFailed(Exception):
    """Raised by a ``check_*`` function; the message says what is wrong and how to fix it."""


class CheckSkipped(Exception):
    """Raised by a ``check_*`` function (or a ``Replay``) that cannot run here; says why."""


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    message: str = ""
    seconds: float = 0.0
    skipped: bool = False


@dataclass
class CheckReport:
    """The outcome of every check for one environment."""

    env_name: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if not r.passed]

    def raise_for_failures(self) -> None:
        if not self.ok:
            raise EnvCheckError(self.env_name, [f"{r.name}: {r.message}" for r in self.failures])


@dataclass
class _Context:
    """What the checks share: the env, how to build a fresh one, and the action sampler."""

    env: gym.Env
    factory: Callable[[], gym.Env] | None
    seed: int
    actions: np.random.Generator
    replay: Replay | None = None
    reference: str | None = None
    """The episode ``_play`` gives at ``seed`` (as JSON), once ``check_seed_determinism`` saw it
    twice: later checks compare against it instead of playing it again (a web env's episode
    costs seconds)."""
    other_episode: list[Any] | None = None
    """The episode at ``seed + 1`` ``check_seed_determinism`` played; ``check_episode_ends``
    judges it instead of playing another."""
    ended: bool = False
    """``env`` sits at the end of an episode ``_play`` ended (no check has touched it since)."""

    def sample_action(self, env: gym.Env) -> str:
        sampler = getattr(env.action_space, "sampler", None)
        return sampler(self.actions) if sampler is not None else env.action_space.sample()


def _json_problem(value: Any, what: str) -> str | None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        return (
            f"{what} is not JSON-serialisable ({exc}); use plain str/int/float/bool/list/dict "
            "values so it can cross the network"
        )
    return None


def _check_reset_output(result: Any, space: gym.Space) -> None:
    if not (isinstance(result, tuple) and len(result) == 2):
        raise CheckFailed(f"reset() must return (observation, info), got {type(result).__name__}")
    observation, info = result
    if isinstance(space, ChatSpace) and not (space.contains(observation) and observation):
        raise CheckFailed(
            f"reset() observation must be a non-empty list of {{'role', 'content': str}} messages, "
            f"got {observation!r:.120}; return a string or messages from on_reset()"
        )
    if not isinstance(info, dict):
        raise CheckFailed(f"reset() info must be a dict, got {type(info).__name__}")
    for problem in (
        _json_problem(observation, "the reset() observation"),
        _json_problem(info, "the reset() info"),
    ):
        if problem:
            raise CheckFailed(problem)


def _check_step_output(result: Any, space: gym.Space) -> tuple[Any, float, bool, bool, dict]:
    if not (isinstance(result, tuple) and len(result) == 5):
        raise CheckFailed("step() must return (observation, reward, terminated, truncated, info)")
    observation, reward, terminated, truncated, info = result
    if isinstance(space, ChatSpace) and not space.contains(observation):
        raise CheckFailed(
            f"step() observation is not a list of chat messages: {observation!r:.120}"
        )
    if (
        not isinstance(reward, (float, int))
        or isinstance(reward, bool)
        or not math.isfinite(reward)
    ):
        raise CheckFailed(f"step() reward must be a finite float, got {reward!r}")
    if not isinstance(terminated, bool) or not isinstance(truncated, bool):
        raise CheckFailed(f"terminated/truncated must be bool, got {terminated!r}, {truncated!r}")
    if terminated and truncated:
        raise CheckFailed(
            "terminated and truncated are both True; an episode ends one way or the other"
        )
    if not isinstance(info, dict):
        raise CheckFailed(f"step() info must be a dict, got {type(info).__name__}")
    for problem in (
        _json_problem(observation, "the step() observation"),
        _json_problem(info, "the step() info"),
    ):
        if problem:
            raise CheckFailed(problem)
    return result


def _play(ctx: _Context, env: gym.Env, seed: int, max_steps: int = MAX_EPISODE_STEPS) -> list[Any]:
    """Play one episode with sampled actions; return everything observed."""
    ctx.actions = np.random.default_rng(seed)
    env.action_space.seed(seed)
    played: list[Any] = [env.reset(seed=seed)]
    for _ in range(max_steps):
        result = env.step(ctx.sample_action(env))
        played.append(result)
        if result[2] or result[3]:
            break
    if env is ctx.env:
        ctx.ended = _over(played)
    return played


def _over(played: list[Any]) -> bool:
    return len(played) > 1 and bool(played[-1][2] or played[-1][3])


def _as_json(played: list[Any]) -> str:
    return json.dumps(played, default=repr)


def transcript(env: gym.Env, seed: int) -> str:
    """The episode the checker's random player plays on ``env`` at ``seed``, as JSON: what a
    new process returns for ``check_new_process`` (same seed, same actions, same text)."""
    ctx = _Context(env=env, factory=None, seed=seed, actions=np.random.default_rng(seed))
    return _as_json(_play(ctx, env, seed))


def _first_difference(a: list[Any], b: list[Any]) -> str:
    """Where two episodes first differ: ``reset()``, ``step N`` or their lengths."""
    for i, (x, y) in enumerate(zip(a, b)):
        if _as_json(x) != _as_json(y):
            return "reset()" if i == 0 else f"step {i}"
    return "their length"


def _play_checked(ctx: _Context, seed: int, *, expert: bool) -> str | None:
    """Play one episode on ``ctx.env`` to its end, checking every output as ``check_reset`` and
    ``check_step`` do: the expert's actions (random ones where it has none), or random ones.
    Until it hands over, each expert action must be valid (``_judge_expert_turn``); returns how
    its episode ended if that was without ``success``, else None."""
    env = ctx.env
    who = "the expert's episode" if expert else "a random episode"
    ctx.actions = np.random.default_rng(seed)
    env.action_space.seed(seed)
    where, handed_over = "reset()", not expert
    try:
        _check_reset_output(env.reset(seed=seed), env.observation_space)
        for turn in range(1, MAX_EPISODE_STEPS + 1):
            action = _expert_action(env) if expert else None
            handed_over = handed_over or action is None
            action = ctx.sample_action(env) if action is None else action
            where = f"step {turn} ({action[:30]!r})"
            result = _check_step_output(env.step(action), env.observation_space)
            lost = None if handed_over else _judge_expert_turn(result)
            if result[2] or result[3]:
                return lost
    except CheckFailed as failure:
        raise CheckFailed(f"{who} with seed={seed}, at {where}: {failure}") from failure
    except (Exception, SystemExit) as exc:
        raise CheckFailed(
            f"{who} with seed={seed} raised {describe_error(exc)} at {where}; reset(), step() "
            "and expert_action() must work on every seed and on the winning turn (envhub check "
            f"--seed {seed} plays this seed first)"
        ) from exc
    raise CheckFailed(
        f"{who} with seed={seed} did not end within {MAX_EPISODE_STEPS} steps; register the env "
        "with max_turns=N so episodes truncate"
    )


def _judge_expert_turn(result: tuple[Any, float, bool, bool, dict]) -> str | None:
    """Raise if the expert's action was refused; say how its episode ended if it lost, else None."""
    observation, reward, terminated, truncated, info = result
    said = observation[-1]["content"] if isinstance(observation, list) and observation else ""
    if info.get("invalid_action") is True:
        raise CheckFailed(
            f"the expert's action was refused as invalid ({said!r:.200}): make the env accept "
            "what its own expert plays (a parser cap below its answers?), or fix expert_action()"
        )
    if (terminated or truncated) and info.get("success") is False:
        return f"reward {reward:g}, {'truncated' if truncated else 'terminated'}: {said!r:.200}"
    return None


def _expert_action(env: gym.Env) -> str | None:
    expert = getattr(env.unwrapped, "expert_action", None)
    return expert() if callable(expert) else None


# ---------------------------------------------------------------------------- checks
def check_spaces(ctx: _Context) -> None:
    """The env declares Gymnasium spaces; text envs use ChatSpace/TextSpace."""
    env = ctx.env
    if not isinstance(env, gym.Env):
        raise CheckFailed(f"{type(env).__name__} is not a gymnasium.Env; subclass envhub.TextEnv")
    for name in ("observation_space", "action_space"):
        if not isinstance(getattr(env, name, None), gym.spaces.Space):
            raise CheckFailed(
                f"{name} is missing or not a gymnasium Space; call super().__init__() in your env"
            )


def check_reset(ctx: _Context) -> None:
    """reset() returns (messages, info), JSON-friendly, with the contract's info keys."""
    _check_reset_output(ctx.env.reset(seed=ctx.seed), ctx.env.observation_space)
    if isinstance(ctx.env.unwrapped, TextEnv):
        _, info = ctx.env.reset(seed=ctx.seed)
        missing = {"turn", "success", "invalid_action"} - set(info)
        if missing:
            raise CheckFailed(
                f"reset() info lacks {sorted(missing)}; don't override TextEnv.reset, implement "
                "on_reset"
            )


def check_step(ctx: _Context) -> None:
    """Each step returns well-typed, finite, JSON-friendly values; bad text never raises."""
    env = ctx.env
    env.reset(seed=ctx.seed)
    probes = [
        "",
        "   ",
        "\x00\x01 not an action %%%",
        "<answer></answer>",
        "x" * 20_000,
        ctx.sample_action(env),
    ]
    for action in probes:
        try:
            result = env.step(action)
        except EpisodeError:
            env.reset(seed=ctx.seed)
            continue
        except (Exception, SystemExit) as exc:
            raise CheckFailed(
                f"step({action[:30]!r}) raised {describe_error(exc)}; answer malformed text "
                "with self.invalid_action(feedback) instead of raising"
            ) from exc
        _check_step_output(result, env.observation_space)
        if result[2] or result[3]:
            env.reset(seed=ctx.seed)


def check_seed_determinism(ctx: _Context) -> None:
    """A seed gives the same episode whatever ran before it: on the same env after another seed,
    and on a fresh env (pools and hubs reuse env objects; eval plays seeds in any order)."""
    seed, other = ctx.seed, ctx.seed + 1
    first = _play(ctx, ctx.env, seed)
    ctx.other_episode = _play(ctx, ctx.env, other)
    again = _play(ctx, ctx.env, seed)
    if _as_json(first) != _as_json(again):
        raise CheckFailed(
            f"two episodes with seed={seed} and the same actions differ at "
            f"{_first_difference(first, again)}, one played before and one after an episode with "
            f"seed={other} on the same env: reset every per-episode field in on_reset, and draw "
            "every random choice from self.np_random (seeded by reset)"
        )
    if ctx.factory is not None:
        fresh = ctx.factory()
        try:
            alone = _play(ctx, fresh, other)
        finally:
            fresh.close()
        if _as_json(alone) != _as_json(ctx.other_episode):
            raise CheckFailed(
                f"seed={other} on a fresh env and seed={other} played after seed={seed} on a used "
                f"env differ at {_first_difference(alone, ctx.other_episode)}: state from an "
                "earlier episode leaks into the next; reset every per-episode field in on_reset, "
                "and draw every random choice from self.np_random (seeded by reset)"
            )
    ctx.reference = _as_json(first)


def check_episode_ends(ctx: _Context) -> None:
    """Episodes end (terminated or truncated) within a bounded number of steps."""
    played = ctx.other_episode or _play(ctx, ctx.env, ctx.seed + 1)
    last = played[-1]
    if not _over(played):
        raise CheckFailed(
            f"an episode of random actions did not end within {MAX_EPISODE_STEPS} steps; "
            "register the env with max_turns=N (or pass max_turns) so episodes truncate"
        )
    info = last[4]
    if isinstance(ctx.env.unwrapped, TextEnv) and not isinstance(info.get("success"), bool):
        raise CheckFailed("the final info must carry success: bool; set Turn(success=...)")


def check_step_after_end(ctx: _Context) -> None:
    """step() after the episode ended is refused with a clear error (``EpisodeOverError``): a
    deliberate difference from Gymnasium's checker, which leaves that to the caller."""
    if not ctx.ended:  # (the checks run just before usually leave an ended episode)
        _play(ctx, ctx.env, ctx.seed + 2)
    try:
        ctx.env.step(ctx.sample_action(ctx.env))
    except EpisodeError:
        return
    except Exception as exc:
        if isinstance(ctx.env.unwrapped, TextEnv):
            raise CheckFailed(
                f"step() after the end raised {type(exc).__name__} ({exc}) instead of "
                "EpisodeOverError; don't override TextEnv.step"
            ) from exc
        return
    raise CheckFailed(
        "step() after the episode ended was accepted; refuse it (TextEnv does so for you)"
    )


def check_step_before_reset(ctx: _Context) -> None:
    """step() on a fresh env is refused, and a non-str action is a TypeError."""
    if ctx.factory is None:
        raise CheckSkipped("needs a factory for a fresh env")
    fresh = ctx.factory()
    try:
        try:
            fresh.step("up")
        except EpisodeError:
            pass
        else:
            raise CheckFailed("step() before reset() was accepted; don't override TextEnv.step")
        fresh.reset(seed=ctx.seed)
        try:
            fresh.step(12345)  # deliberately not a str
        except TypeError:
            pass
        else:
            raise CheckFailed("step(12345) was accepted; actions are the model's text (str)")
    finally:
        fresh.close()


def check_picklable(ctx: _Context) -> None:
    """The env pickles, and the copy plays the same episode (process workers need this)."""
    ctx.env.reset(seed=ctx.seed)
    try:
        copy = pickle.loads(pickle.dumps(ctx.env))
    except Exception as exc:
        raise CheckFailed(
            f"pickle failed ({type(exc).__name__}: {exc}); keep open handles (sockets, processes) "
            "out of __init__ or implement __getstate__/__setstate__"
        ) from exc
    try:
        played = _as_json(_play(ctx, copy, ctx.seed))
        original = ctx.reference or _as_json(_play(ctx, ctx.env, ctx.seed))
        if played != original:
            raise CheckFailed(
                "the unpickled copy plays a different episode for the same seed and actions"
            )
    finally:
        copy.close()


def check_new_process(ctx: _Context) -> None:
    """A new Python process with another ``PYTHONHASHSEED`` plays the same episode for the seed
    (every pool, hub and trainer worker is such a process)."""
    if ctx.replay is None:
        raise CheckSkipped("needs a registered id: envhub check ID runs it in a new process")
    if ctx.reference is None:
        raise CheckSkipped("the seed determinism check failed")
    theirs = ctx.replay(ctx.seed)
    if theirs != ctx.reference:
        where = _first_difference(json.loads(ctx.reference), json.loads(theirs))
        raise CheckFailed(
            f"seed={ctx.seed} played in a new Python process (another PYTHONHASHSEED) differs at "
            f"{where} from the same seed here: the env depends on something besides the seed, "
            "such as the order of a set or hash() of a str; sort before drawing (sorted(...)) "
            "and draw every random choice from self.np_random"
        )


def check_expert_episode(ctx: _Context) -> None:
    """The env's expert (``expert_action``) plays to the end, outputs well-formed, every action
    valid, and wins (within ``EXPERT_EPISODES`` seeds): the winning turn, which random play rarely
    reaches, is where eval and training go. An expert that returns None mid-episode hands over
    to random actions, whose episode need not win."""
    ctx.env.reset(seed=ctx.seed)
    try:
        has_expert = _expert_action(ctx.env) is not None
    except (Exception, SystemExit) as exc:
        raise CheckFailed(
            f"expert_action() after reset(seed={ctx.seed}) raised {describe_error(exc)}; return "
            "a good next action, or None when the env has no expert"
        ) from exc
    if not has_expert:
        raise CheckSkipped("the env has no expert (expert_action() returned None)")
    first = _play_checked(ctx, ctx.seed, expert=True)
    seeds = range(ctx.seed + 1, ctx.seed + EXPERT_EPISODES)
    if first is not None and all(_play_checked(ctx, s, expert=True) for s in seeds):
        raise CheckFailed(
            f"the expert's episodes with seeds {ctx.seed} to {seeds[-1]} all ended without "
            f"success (seed={ctx.seed}: {first}): fix the env's scoring or expert_action(), or "
            "return None from expert_action() where the env has no expert"
        )


def check_more_seeds(ctx: _Context) -> None:
    """Random episodes on more seeds, one far away (``FAR_SEED_OFFSET``), end with well-formed
    outputs and raise nothing."""
    for offset in MORE_SEED_OFFSETS:
        _play_checked(ctx, ctx.seed + offset, expert=False)


def check_gymnasium(ctx: _Context) -> None:
    """Gymnasium's own env checker passes (its warnings are ignored)."""
    from gymnasium.utils.env_checker import check_env as gymnasium_check_env

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            gymnasium_check_env(ctx.env.unwrapped, skip_render_check=True)
        except Exception as exc:
            raise CheckFailed(
                f"gymnasium.utils.env_checker.check_env failed: {type(exc).__name__}: {exc}"
            ) from exc


def check_close_twice(ctx: _Context) -> None:
    """close() can be called twice without error."""
    for attempt in ("first", "second"):
        try:
            ctx.env.close()
        except Exception as exc:
            raise CheckFailed(
                f"the {attempt} close() raised {type(exc).__name__}: {exc}; make close() idempotent"
            ) from exc


CHECKS: list[Callable[[_Context], None]] = [
    check_spaces,
    check_reset,
    check_step,
    check_seed_determinism,
    check_episode_ends,
    check_step_after_end,
    check_step_before_reset,
    check_picklable,
    check_new_process,
    check_expert_episode,
    check_more_seeds,
    check_gymnasium,
    check_close_twice,
]
"""The checks ``check_env`` runs, in order (``check_close_twice`` must stay last)."""

_KEEP_ENV_AS_PLAYED = (check_seed_determinism, check_episode_ends)
"""Checks after which ``env`` is where ``_play`` left it (the rest use it, or may)."""


def check_env(
    env: gym.Env,
    *,
    factory: Callable[[], gym.Env] | None = None,
    seed: int = 0,
    raise_on_failure: bool = True,
    gymnasium_checks: bool = True,
    on_result: Callable[[CheckResult], None] | None = None,
    replay: Replay | None = None,
) -> CheckReport:
    """Run every check against ``env`` and report all problems at once.

    ``factory`` builds a fresh env (enables the step-before-reset check and the fresh-env half
    of the determinism check); ``replay`` plays a seed in a new process (``envhub check`` passes
    one; without it ``check_new_process`` is skipped); ``on_result`` is called after each check
    (the CLI prints them live). Closes ``env`` at the end. Raises ``EnvCheckError`` listing
    every failure unless ``raise_on_failure=False``.
    """
    name = getattr(getattr(env, "spec", None), "id", None) or type(env).__name__
    ctx = _Context(
        env=env, factory=factory, seed=seed, actions=np.random.default_rng(seed), replay=replay
    )
    report = CheckReport(env_name=name)
    for check in CHECKS:
        if check is check_gymnasium and not gymnasium_checks:
            continue
        start = time.perf_counter()
        try:
            check(ctx)
            result = CheckResult(check.__name__, True, seconds=time.perf_counter() - start)
        except CheckSkipped as skip:
            result = CheckResult(
                check.__name__, True, f"skipped: {skip}", time.perf_counter() - start, skipped=True
            )
        except CheckFailed as failure:
            result = CheckResult(check.__name__, False, str(failure), time.perf_counter() - start)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - an env crash fails the check, not the checker
            message = (
                f"the env raised {describe_error(exc)}; reset() and step() must not raise or exit "
                "for any text (answer bad actions with self.invalid_action(feedback))"
            )
            result = CheckResult(check.__name__, False, message, time.perf_counter() - start)
        ctx.ended = ctx.ended and check in _KEEP_ENV_AS_PLAYED
        report.results.append(result)
        if on_result is not None:
            on_result(result)
        if check is check_spaces and not result.passed:
            with contextlib.suppress(Exception):  # nothing else can run on what is not an env
                env.close()  # (what it holds is freed)
            break
    if raise_on_failure:
        report.raise_for_failures()
    return report
