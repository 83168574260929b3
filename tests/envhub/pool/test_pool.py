"""EnvPool over real worker processes: results, concurrency, crash/hang healing, back-pressure,
shutdown."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

import envhub
from envhub.errors import EpisodeOverError
from envhub.pool import (
    EnvPool,
    EpisodeFailure,
    PoolFullError,
    UnknownEpisodeError,
    WorkerStartError,
)
from envhub.registry import EnvSpec
from tests.envhub.pool.faulty_envs import FAULTY
from tests.helpers import process_alive


def run(coro, timeout: float = 60.0):
    """Run a test coroutine; a hang fails the test instead of blocking the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_pool_matches_the_local_env_step_for_step():
    async def main():
        local = envhub.make("games/sokoban-v0")
        async with EnvPool("games/sokoban-v0", num_workers=2) as pool:
            first = await pool.reset(seed=7)
            messages, info = local.reset(seed=7)
            assert first.observation == messages and first.info == info
            for action in ["<answer>up</answer>", "nonsense", "<answer>left</answer>"]:
                remote = await pool.step(first.episode, action)
                obs, reward, terminated, truncated, info = local.step(action)
                assert (
                    remote.observation,
                    remote.reward,
                    remote.terminated,
                    remote.truncated,
                    remote.info,
                ) == (obs, reward, terminated, truncated, info)
            await pool.close_episode(first.episode)
            assert pool.stats().episodes == 0

    run(main())


def test_many_concurrent_episodes_spread_over_workers():
    async def main():
        async with EnvPool(FAULTY, num_workers=2) as pool:
            started = await asyncio.gather(*(pool.reset(seed=i) for i in range(40)))
            pids = {r.info["pid"] for r in started}
            assert len(pids) == 2, "episodes should be spread over both workers"
            results = await asyncio.gather(
                *(pool.step(r.episode, f"a{r.episode}") for r in started)
            )
            assert [r.observation[0]["content"] for r in results] == [
                f"echo a{r.episode}" for r in started
            ]
            assert pool.stats().steps == 40

    run(main())


def test_large_actions_and_answers_cross_the_worker_socket_intact():
    """Frames bigger than a socket buffer arrive in pieces, on both sides of the worker's socket:
    every echo must still come back whole and to the episode that sent it."""

    async def main():
        async with EnvPool(FAULTY, num_workers=1) as pool:
            started = await asyncio.gather(*(pool.reset(seed=i) for i in range(6)))
            actions = [chr(ord("a") + i) * (300_000 + 7919 * i) for i in range(len(started))]
            for _ in range(2):
                results = await asyncio.gather(
                    *(pool.step(r.episode, a) for r, a in zip(started, actions, strict=True))
                )
                got = [r.observation[0]["content"] for r in results]
                assert got == [f"echo {a}" for a in actions]

    run(main())


def test_a_crashed_worker_fails_its_episodes_as_data_and_is_replaced():
    async def main():
        async with EnvPool(FAULTY, num_workers=2) as pool:
            eps = [await pool.reset(seed=i) for i in range(6)]
            victim = eps[0]
            victim_pid = victim.info["pid"]
            neighbours = [e for e in eps[1:] if e.info["pid"] == victim_pid]
            others = [e for e in eps if e.info["pid"] != victim_pid]
            assert neighbours and others
            results = await asyncio.gather(
                pool.step(victim.episode, "crash"), *(pool.step(e.episode, "x") for e in others)
            )
            crashed = results[0]
            assert isinstance(crashed, EpisodeFailure) and crashed.reason == "worker_crashed"
            assert "exit code 3" in crashed.detail
            assert all(not r.failed for r in results[1:]), (
                "episodes on the healthy worker must not fail"
            )
            lost = await pool.step(neighbours[0].episode, "x")
            assert isinstance(lost, EpisodeFailure) and lost.reason == "worker_lost"
            assert (await pool.step(victim.episode, "x")) == crashed, (
                "a failed episode keeps answering with its record"
            )
            for _ in range(100):
                if pool.stats().workers_alive == 2:
                    break
                await asyncio.sleep(0.1)
            stats = pool.stats()
            assert stats.workers_alive == 2 and stats.worker_restarts == 1
            again = await pool.reset(victim.episode, seed=1)
            assert not again.failed and again.episode == victim.episode
            assert not (await pool.step(victim.episode, "y")).failed
            assert not process_alive(victim_pid)

    run(main())


def test_a_hung_step_is_killed_at_the_timeout_and_the_pool_heals():
    async def main():
        async with EnvPool(FAULTY, num_workers=1, step_timeout_s=1.0) as pool:
            ep = await pool.reset(seed=0)
            began = time.monotonic()
            result = await pool.step(ep.episode, "hang")
            waited = time.monotonic() - began
            assert isinstance(result, EpisodeFailure) and result.reason == "step_timeout"
            assert "past the 1 s timeout" in result.detail
            # never before the timeout (a lower bound cannot flake; a hang hits the test timeout)
            assert waited >= 0.9
            fresh = await pool.reset(seed=1, wait_s=30)
            assert fresh.info["pid"] != ep.info["pid"]
            assert (await pool.step(fresh.episode, "ok")).observation[0]["content"] == "echo ok"

    run(main())


def test_an_env_exception_fails_only_that_episode():
    async def main():
        async with EnvPool(FAULTY, num_workers=1) as pool:
            a, b = await pool.reset(seed=0), await pool.reset(seed=1)
            broken = await pool.step(a.episode, "raise")
            assert isinstance(broken, EpisodeFailure) and broken.reason == "env_error"
            assert "the env broke on purpose" in broken.detail
            assert (await pool.step(b.episode, "fine")).info["pid"] == b.info["pid"]
            assert pool.stats().worker_restarts == 0

    run(main())


def test_caller_mistakes_raise_like_the_local_env():
    async def main():
        async with EnvPool(FAULTY, num_workers=1) as pool:
            with pytest.raises(UnknownEpisodeError, match="call reset"):
                await pool.step(12345, "x")
            ep = await pool.reset(seed=0)
            assert (await pool.step(ep.episode, "win")).terminated
            with pytest.raises(EpisodeOverError, match="after the episode ended"):
                await pool.step(ep.episode, "x")
            with pytest.raises(TypeError, match=r"\(a str\) or an assistant message"):
                await pool.step(ep.episode, 42)
            again = await pool.reset(ep.episode, seed=0)
            assert not again.failed

    run(main())


def test_a_reset_whose_arguments_cannot_be_sent_holds_no_slot():
    """A seed past 64 bits (or options the wire cannot encode) is refused before an episode is
    placed: with one slot, a refused reset must leave that slot free for the next caller."""

    async def main():
        async with EnvPool(FAULTY, num_workers=1, max_episodes=1) as pool:
            for bad in ({"seed": 2**70}, {"options": {"x": 2**70}}):
                with pytest.raises(TypeError, match="cannot be sent to the env worker"):
                    await pool.reset(**bad)
                assert pool.stats().episodes == 0
            assert not (await pool.reset(seed=0, wait_s=1.0)).failed

    run(main())


def test_back_pressure_waits_for_a_free_slot():
    async def main():
        async with EnvPool(FAULTY, num_workers=1, max_episodes=2) as pool:
            a, _ = await pool.reset(seed=0), await pool.reset(seed=1)
            with pytest.raises(PoolFullError, match="all 2 episode slots are busy"):
                await pool.reset(seed=2, wait_s=0.2)
            waiting = asyncio.ensure_future(pool.reset(seed=3, wait_s=10))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            await pool.close_episode(a.episode)
            assert not (await waiting).failed

    run(main())


def test_close_leaves_no_worker_process_behind():
    async def main():
        pool = EnvPool(FAULTY, num_workers=3)
        await pool.start()
        pids = [w.pid for w in pool.workers()]
        assert all(process_alive(p) for p in pids)
        ep = await pool.reset(seed=0)
        await pool.aclose()
        assert (await pool.step(ep.episode, "x")).reason == "pool_closed"
        for _ in range(50):
            if not any(process_alive(p) for p in pids):
                break
            await asyncio.sleep(0.1)
        assert not any(process_alive(p) for p in pids)

        quick = EnvPool(FAULTY, num_workers=2)
        await quick.start()
        pids = [w.pid for w in quick.workers()]
        quick.close()  # the synchronous kill
        for _ in range(50):
            if not any(process_alive(p) for p in pids):
                break
            await asyncio.sleep(0.1)
        assert not any(process_alive(p) for p in pids)

    run(main())


def test_a_bad_env_fails_at_start_with_the_workers_error():
    bad = EnvSpec(id="test/bad-v0", entry_point="tests.envhub.pool.faulty_envs:NoSuchEnv")

    async def main():
        with pytest.raises(WorkerStartError, match="NoSuchEnv"):
            await EnvPool(bad, num_workers=1).start()

    run(main())


def test_inline_backend_runs_in_process_and_reports_env_errors():
    async def main():
        async with EnvPool(FAULTY, num_workers=1, backend="inline") as pool:
            ep = await pool.reset(seed=0)
            assert ep.info["pid"] == os.getpid()
            assert (await pool.step(ep.episode, "hi")).observation[0]["content"] == "echo hi"
            assert (await pool.step(ep.episode, "raise")).reason == "env_error"

    run(main())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_workers": 0}, "num_workers must be a positive int"),
        ({"backend": "threads"}, "backend must be one of"),
        ({"step_timeout_s": -1}, "step_timeout_s must be a positive number"),
        ({"max_episodes": 0}, "max_episodes must be a positive int"),
    ],
)
def test_bad_settings_are_refused_with_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EnvPool(FAULTY, **kwargs)
