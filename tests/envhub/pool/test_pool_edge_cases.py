"""EnvPool at the edges of its bookkeeping: a worker dying while the pool starts, request and
episode ids past 2**32, observations that are not chat messages, and on the Ray backend the
answer cap, a call Ray refuses, a close with a call in flight and an actor dying while idle. One
property per test, asserted as a user sees it.

The envs the worker processes build live here too (importable as
``tests.envhub.pool.test_pool_edge_cases``). The Ray tests share one local Ray instance.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from envhub.core import TextEnv, Turn
from envhub.errors import EpisodeError
from envhub.pool import EnvPool, EpisodeFailure
from envhub.registry import EnvSpec
from tests.envhub.pool.faulty_envs import FAULTY

T = TypeVar("T")

SLOW_AFTER_FIRST = EnvSpec(
    id="test/slow-after-first-v0",
    entry_point="tests.envhub.pool.test_pool_edge_cases:SlowAfterFirstEnv",
)
CHATLESS = EnvSpec(
    id="test/chatless-v0", entry_point="tests.envhub.pool.test_pool_edge_cases:ChatlessEnv"
)


class SlowAfterFirstEnv(TextEnv):
    """The first build (it creates the file ``first``) is at once; later builds wait while the
    file ``hold`` exists."""

    def __init__(self, *, first: str, hold: str, **kwargs: Any) -> None:
        try:
            os.close(os.open(first, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            while os.path.exists(hold):
                time.sleep(0.02)
        super().__init__(**kwargs)

    def on_reset(self, options):
        return f"pid {os.getpid()}", {"pid": os.getpid()}

    def on_step(self, action):
        return Turn("ok")


class ChatlessEnv:
    """A user env (the registry takes any class) whose ``bad`` call, ``reset`` or ``step``,
    returns ``observation`` instead of chat messages."""

    def __init__(self, bad: str = "step", observation: Any = "ok") -> None:
        self.bad, self.observation = bad, observation

    def reset(self, *, seed=None, options=None):
        good = [{"role": "user", "content": "go"}]
        return (self.observation if self.bad == "reset" else good), {}

    def step(self, action):
        good = [{"role": "tool", "content": "ok", "tool_call_id": "1", "name": "f"}]
        return (self.observation if self.bad == "step" else good), 1.0, False, False, {}

    def close(self):
        pass


def run(coro, timeout: float = 60.0):
    """Run a test coroutine; a hang fails the test instead of blocking the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(condition: Callable[[], T], what: str, timeout: float = 30.0) -> T:
    """Poll ``condition`` until it is truthy (its value), failing after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (value := condition()):
        assert loop.time() < deadline, f"waited {timeout:g} s for {what}"
        await asyncio.sleep(0.02)
    return value


# ---------------------------------------------------------------------- start-up
@pytest.mark.timeout(90)
def test_a_worker_that_dies_while_the_pool_starts_its_siblings_is_replaced(tmp_path):
    first, hold = tmp_path / "first", tmp_path / "hold"
    hold.touch()

    async def main():
        pool = EnvPool(
            SLOW_AFTER_FIRST,
            num_workers=2,
            env_kwargs={"first": str(first), "hold": str(hold)},
        )
        starting = asyncio.ensure_future(pool.start())
        try:
            fast = await until(
                lambda: next((w for w in pool.workers() if w.alive), None), "the first worker"
            )
            os.kill(fast.pid, signal.SIGKILL)
            await until(lambda: not fast.alive, "the pool to see the first worker die")
            hold.unlink()  # the other worker (and any replacement) may build now
            await starting
            await until(lambda: pool.stats().workers_alive == 2, "a replacement for the dead one")
            assert pool.stats().worker_restarts == 1
            started = [await pool.reset(seed=i) for i in range(2)]
            assert len({r.info["pid"] for r in started}) == 2, "episodes go to both workers"
        finally:
            await pool.aclose()

    run(main(), timeout=80)


# ---------------------------------------------------------------------- requests
@pytest.mark.timeout(60)
def test_a_worker_keeps_answering_past_two_to_the_32_requests():
    """Request ids travel as 32-bit numbers: after 2**32 requests on one worker they wrap, and
    steps go on as before (no error, nothing left in flight, no worker killed later)."""

    async def main():
        async with EnvPool(FAULTY, num_workers=1) as pool:
            a, b = await pool.reset(seed=0), await pool.reset(seed=1)
            worker = pool.workers()[0]
            worker._ids = itertools.count(2**32 - 2)  # as after ~4.3e9 requests
            for i in range(4):
                result = await pool.step(a.episode, f"s{i}")
                assert result.observation[-1]["content"] == f"echo s{i}"
            assert worker.inflight == 0
            assert not (await pool.step(b.episode, "x")).failed
            assert pool.stats().worker_restarts == 0

    run(main())


@pytest.mark.timeout(60)
def test_a_pool_keeps_starting_episodes_past_two_to_the_32():
    """A long-lived hub numbers its episodes past 2**32 (50 days at 1,000 episodes/s): those
    episodes reset, step and close like the first ones, each under its own id."""

    async def main():
        async with EnvPool(FAULTY, num_workers=1) as pool:
            pool._ids = itertools.count(2**32 - 1)  # as after ~4.3e9 episodes
            started = [await pool.reset(seed=i) for i in range(3)]
            assert [r.episode for r in started] == [2**32 - 1, 2**32, 2**32 + 1]
            for r in started:
                assert (await pool.step(r.episode, f"e{r.episode}")).observation[-1][
                    "content"
                ] == f"echo e{r.episode}"
                await pool.close_episode(r.episode)
            assert pool.stats().episodes == 0 and pool.stats().worker_restarts == 0

    run(main())


# ---------------------------------------------------------------------- observations
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("bad", "observation", "problem"),
    [
        ("reset", "hello", "observation of type str"),
        ("step", "ok", "observation of type str"),
        ("step", ["ok"], "observation[0] of type str"),
        ("step", [{"role": "user"}], "observation[0] has no str 'content'"),
        ("step", [{"role": "user", "content": 3}], "observation[0] has no str 'content'"),
        ("step", [{"content": "ok"}], "observation[0] has no str 'role'"),
        (
            "step",
            [{"role": "user", "content": [{"type": "image_url"}]}],
            "observation[0] has no str 'content'",
        ),
    ],
)
def test_an_observation_that_is_not_chat_messages_fails_its_episode(bad, observation, problem):
    """The env's observation must be a list of ``{"role": str, "content": str}`` messages (the
    ``TextEnv`` contract): anything else fails the episode as ``env_error``, naming the call and
    what is wrong, and never reaches the pool's user."""

    async def main():
        kwargs = {"bad": bad, "observation": observation}
        async with EnvPool(CHATLESS, num_workers=1, backend="inline", env_kwargs=kwargs) as pool:
            result = await pool.reset(seed=0)
            if bad == "step":
                result = await pool.step(result.episode, "a")
            assert isinstance(result, EpisodeFailure) and result.reason == "env_error", result
            assert f"ChatlessEnv.{bad} returned {problem}" in result.detail
            assert "a list of chat messages" in result.detail
            assert pool.stats().workers_alive == 1 and pool.stats().worker_restarts == 0

    run(main())


def test_chat_messages_with_extra_keys_pass_the_observation_check():
    async def main():
        kwargs = {"bad": "reset", "observation": [{"role": "user", "content": "hi", "name": "x"}]}
        async with EnvPool(CHATLESS, num_workers=1, backend="inline", env_kwargs=kwargs) as pool:
            started = await pool.reset(seed=0)
            assert started.observation == [{"role": "user", "content": "hi", "name": "x"}]
            stepped = await pool.step(started.episode, "a")
            assert stepped.observation[0]["tool_call_id"] == "1"

    run(main())


def test_text_content_parts_pass_the_observation_check():
    """OpenAI's content parts (text only), as a chat-API user writes a message: a trainer reads
    them as their joined text, so the pool lets them through unchanged."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]

    async def main():
        kwargs = {"bad": "reset", "observation": parts}
        async with EnvPool(CHATLESS, num_workers=1, backend="inline", env_kwargs=kwargs) as pool:
            started = await pool.reset(seed=0)
            assert not isinstance(started, EpisodeFailure), started
            assert started.observation == parts

    run(main())


@pytest.mark.parametrize("reward", [1e39, -1e39, 10**40, 10**400])
def test_a_reward_beyond_float32_fails_its_episode_naming_it(reward):
    """Finite in Python, ``inf`` in a trainer's float32 tensors (NaN advantages): refused."""
    from envhub.pool.host import step_output_problem

    problem = step_output_problem(reward, False, False, {})
    assert problem.startswith(f"reward={reward!r}"[:12]) and "must fit float32" in problem
    assert step_output_problem(3.0e38, False, False, {}) == ""  # the largest float32s pass


# ---------------------------------------------------------------------- ray
@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray keeps the first auth mode a process saw: the two-node cluster of test_ray.py, later in
    # this process, runs with auth disabled (loopback only), so this one does too
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()
    monkeypatch.undo()


@pytest.mark.timeout(120)
def test_a_ray_worker_caps_its_answers_like_a_process_worker(local_ray):
    async def main():
        async with EnvPool(FAULTY, num_workers=1, backend="ray", max_message_bytes=1000) as pool:
            a, b = await pool.reset(seed=0), await pool.reset(seed=1)
            big = await pool.step(a.episode, "x" * 5000)
            assert isinstance(big, EpisodeFailure) and big.reason == "env_error", big
            assert "max_message_bytes=1000" in big.detail
            assert not (await pool.step(b.episode, "small")).failed
            assert pool.stats().worker_restarts == 0

    run(main(), timeout=110)


@pytest.mark.timeout(120)
def test_a_ray_call_refused_at_submit_raises_and_leaves_the_worker_serving(local_ray):
    """With ``max_pending_calls=1`` Ray refuses a second call while one runs: that call raises an
    ``EpisodeError`` naming the limit; the worker has nothing left in flight and serves on."""

    async def main():
        async with EnvPool(
            FAULTY,
            num_workers=1,
            backend="ray",
            step_timeout_s=5,
            ray_options={"max_pending_calls": 1},
        ) as pool:
            a, b = await pool.reset(seed=0), await pool.reset(seed=1)
            slow, refused = await asyncio.gather(
                pool.step(a.episode, "sleep:0.5"), pool.step(b.episode, "x"), return_exceptions=True
            )
            assert not slow.failed, slow
            assert isinstance(refused, EpisodeError), refused
            assert "refused" in str(refused) and "max_pending_calls" in str(refused)
            assert pool.workers()[0].inflight == 0
            assert not (await pool.step(b.episode, "y")).failed
            assert pool.stats().worker_restarts == 0

    run(main(), timeout=110)


@pytest.mark.timeout(120)
def test_closing_a_ray_pool_with_a_step_in_flight_logs_no_error_afterwards(local_ray, caplog):
    """The killed actor's answer arrives after the event loop closed: it is dropped quietly, not
    logged as ``RuntimeError: Event loop is closed`` from Ray's callback thread."""
    caplog.set_level(logging.ERROR)
    held: dict[str, Any] = {}

    async def main():
        pool = EnvPool(FAULTY, num_workers=1, backend="ray")
        await pool.start()
        ep = await pool.reset(seed=0)
        held["actor"] = pool.workers()[0]._actor
        step = asyncio.ensure_future(pool.step(ep.episode, "hang"))
        await until(lambda: pool.workers()[0].inflight, "the step to be sent")
        pool.close()
        assert (await step).reason == "pool_closed"

    run(main(), timeout=110)
    # a call made now fails once Ray knows the actor died; its callback runs after the in-flight
    # call's (Ray runs them in order on one thread)
    with pytest.raises(local_ray.exceptions.RayActorError):
        held["actor"].where.remote().future().result(timeout=60)
    assert not [r.getMessage() for r in caplog.records if r.exc_info], "an error was logged"


@pytest.mark.timeout(120)
def test_a_ray_worker_that_dies_while_idle_is_replaced_before_the_next_reset(local_ray):
    """Nothing is in flight when the actor dies: the pool notices on its own (``envhub serve``'s
    health reports a live worker again), and a new episode starts on the replacement."""

    async def main():
        async with EnvPool(FAULTY, num_workers=1, backend="ray") as pool:
            old = await pool.reset(seed=0)
            worker = pool.workers()[0]
            os.kill(worker.pid, signal.SIGKILL)
            await until(
                lambda: pool.stats().worker_restarts == 1 and pool.stats().workers_alive == 1,
                "the pool to replace the dead actor",
            )
            assert pool.workers()[0] is not worker
            fresh = await pool.reset(seed=1)
            assert not fresh.failed, fresh
            assert not (await pool.step(fresh.episode, "x")).failed
            lost = await pool.step(old.episode, "x")
            assert isinstance(lost, EpisodeFailure) and lost.reason == "worker_crashed", lost

    run(main(), timeout=110)
