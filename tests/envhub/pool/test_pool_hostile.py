"""EnvPool against hostile envs: crash loops, hangs among neighbours, helper processes, failed
and abandoned resets, signals, oversized answers. One property per test, asserted as a user sees
it: processes left, the error a call raises, the episode a failure names."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from envhub.pool import EnvPool, EpisodeFailure, WorkerStartError
from envhub.pool.framing import FrameReader, FrameTooLargeError
from tests.envhub.pool.hostile_envs import HOSTILE, survivors


def run(coro, timeout: float = 60.0):
    """Run a test coroutine; a hang fails the test instead of blocking the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


_EARLIER: set[int] = set()
"""Descendants started before the running test (by other tests: a Ray cluster, say)."""


def live_children() -> list[psutil.Process]:
    """This process's descendants the running test started that still run (zombies are
    dead)."""
    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.pid not in _EARLIER and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture(autouse=True)
def _no_leftovers():
    """Whatever a failing test leaves running is killed (the tests assert on processes)."""
    _EARLIER.clear()
    _EARLIER.update(p.pid for p in live_children())
    yield
    for proc in live_children():
        proc.kill()


@contextlib.asynccontextmanager
async def crashed_pool(flag: Path, **options: Any) -> AsyncIterator[EnvPool]:
    """A one-worker pool of ``HOSTILE`` whose worker just crashed, and whose env no longer
    builds (``flag`` exists): its replacement fails to start."""
    async with EnvPool(
        HOSTILE, num_workers=1, env_kwargs={"refuse_while": str(flag)}, **options
    ) as pool:
        first = await pool.reset(seed=0)
        flag.touch()
        assert (await pool.step(first.episode, "crash")).reason == "worker_crashed"
        yield pool


# ---------------------------------------------------------------------- crash loops (1)
def test_a_crash_loop_restarts_the_slot_once_and_leaves_one_process(tmp_path: Path):
    """The replacement of a crashed worker fails to build the env 3 times, then succeeds: the
    pool counts one restart, runs one worker process, and leaves none after close."""
    counter = tmp_path / "builds"

    async def main():
        pool = EnvPool(
            HOSTILE,
            num_workers=1,
            env_kwargs={"refuse_builds": str(counter), "refusals": 3},
            step_timeout_s=30,
        )
        await pool.start()
        first = await pool.reset(seed=0)
        counter.touch()  # from now on the next 3 builds fail
        assert (await pool.step(first.episode, "crash")).reason == "worker_crashed"
        again = await pool.reset(seed=1, wait_s=60)
        assert not again.failed
        assert pool.stats().worker_restarts == 1
        assert [p.pid for p in live_children()] == [w.pid for w in pool.workers()]
        pids = [p.pid for p in live_children()]
        await pool.aclose()
        assert survivors(pids) == []

    run(main())


def test_a_worker_that_cannot_be_rebuilt_fails_waiting_resets_with_its_error(tmp_path: Path):
    """An env that stops building after a crash: a reset without ``wait_s`` raises
    ``WorkerStartError`` naming the env and the build error once the restarts are spent."""

    async def main():
        async with crashed_pool(tmp_path / "refuse", restart_attempts=2) as pool:
            with pytest.raises(WorkerStartError) as caught:
                await pool.reset(seed=1)
            message = str(caught.value)
            assert HOSTILE.id in message and "refuses to build" in message
            assert "restart_attempts" in message
            assert survivors([p.pid for p in live_children()]) == []

    run(main())


def test_a_given_up_pool_starts_its_workers_again_once_retry_after_s_has_passed(tmp_path: Path):
    """After giving up, a pool is not down for good: a reset ``retry_after_s`` later runs one
    more round of starts, so once the env builds again resets work without a new pool."""
    flag = tmp_path / "refuse"

    async def main():
        async with crashed_pool(flag, restart_attempts=1, retry_after_s=0) as pool:
            with pytest.raises(WorkerStartError, match="refuses to build"):
                await pool.reset(seed=1)  # (the retry this reset ran failed too)
            flag.unlink()  # the env is fixed
            again = await pool.reset(seed=2)
            assert not again.failed and pool.stats().workers_alive == 1
            assert [p.pid for p in live_children()] == [w.pid for w in pool.workers()]

    run(main())


def test_a_given_up_pool_says_when_it_tries_again_and_starts_nothing_before(tmp_path: Path):
    async def main():
        flag = tmp_path / "refuse"
        async with crashed_pool(flag, restart_attempts=1, retry_after_s=3600) as pool:
            for seed in (1, 2):
                with pytest.raises(WorkerStartError, match=r"tries again in 3\d\d\d s"):
                    await pool.reset(seed=seed)
            # the crashed worker may still be exiting: it must end, and nothing else run
            _, alive = psutil.wait_procs(live_children(), timeout=10)
            assert pool.given_up and alive == []
            assert pool.stats().worker_restarts == 1  # the second reset started nothing

    run(main())


# ---------------------------------------------------------------------- resets (4)
def test_a_cancelled_reset_leaves_no_episode_in_the_pool():
    """A caller that gives up on a reset (``asyncio.wait_for``) does not leave its episode."""

    async def main():
        async with EnvPool(HOSTILE, num_workers=1) as pool:
            resetting = asyncio.ensure_future(pool.reset(seed=0))
            await asyncio.sleep(0)  # it placed its episode and sent the reset
            assert pool.stats().episodes == 1
            resetting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await resetting
            assert pool.stats().episodes == 0
            assert not (await pool.reset(seed=1)).failed

    run(main())


# ---------------------------------------------------------------------- blame (3)
def test_a_fine_step_is_not_blamed_for_a_hanging_neighbour():
    """Two episodes on one worker: one step answers at once, the other hangs. The fine one
    gets its answer; only the hanging one fails with ``step_timeout``."""

    async def main():
        async with EnvPool(HOSTILE, num_workers=1, step_timeout_s=1.0) as pool:
            a, b = await pool.reset(seed=0), await pool.reset(seed=1)
            fine, hung = await asyncio.gather(
                pool.step(a.episode, "fine"), pool.step(b.episode, "hang")
            )
            assert not fine.failed, fine
            assert isinstance(hung, EpisodeFailure) and hung.reason == "step_timeout"
            assert f"episode {b.episode}'s step" in hung.detail

    run(main())


def test_each_queued_step_gets_its_own_timeout():
    """Four steps of 0.3 s queued on one worker with a 1 s timeout: each is within its bound."""

    async def main():
        async with EnvPool(HOSTILE, num_workers=1, step_timeout_s=1.0) as pool:
            eps = [await pool.reset(seed=i) for i in range(4)]
            results = await asyncio.gather(*(pool.step(e.episode, "sleep:0.3") for e in eps))
            assert [r.failed for r in results] == [False] * 4, results

    run(main())


# ---------------------------------------------------------------------- processes (2, 6)
def test_a_crash_is_seen_at_once_even_when_a_forked_helper_holds_the_socket():
    """The env forks a helper (it inherits the worker's socket), then the worker exits: the step
    fails as ``worker_crashed`` at once, not at the step timeout, and the helper is gone."""

    async def main():
        async with EnvPool(HOSTILE, num_workers=1, step_timeout_s=300) as pool:
            ep = await pool.reset(seed=0)
            helper = (await pool.step(ep.episode, "fork")).info["helper"]
            crashed = await pool.step(ep.episode, "crash")
            assert crashed.reason == "worker_crashed" and "exit code 3" in crashed.detail
            assert survivors([helper]) == []

    run(main(), timeout=30)


def test_an_envs_helper_processes_die_with_its_worker_and_with_the_pool():
    async def main():
        async with EnvPool(HOSTILE, num_workers=1, step_timeout_s=1.0) as pool:
            ep = await pool.reset(seed=0)
            helper = (await pool.step(ep.episode, "spawn")).info["helper"]
            assert (await pool.step(ep.episode, "hang")).reason == "step_timeout"
            assert survivors([helper]) == [], "a killed worker's helpers must die with it"
            ep = await pool.reset(seed=1, wait_s=30)
            helper = (await pool.step(ep.episode, "spawn")).info["helper"]
        assert survivors([helper]) == [], "a closed pool's helpers must die with it"

    run(main())


def test_closing_the_pool_while_a_replacement_starts_leaves_no_process(tmp_path: Path):
    slow = tmp_path / "slow"

    async def main():
        pool = EnvPool(HOSTILE, num_workers=1, env_kwargs={"slow_while": str(slow)})
        await pool.start()
        ep = await pool.reset(seed=0)
        first = ep.info["pid"]
        slow.touch()  # the replacement blocks while it builds the env
        assert (await pool.step(ep.episode, "crash")).reason == "worker_crashed"
        starting = [p.pid for p in live_children() if p.pid != first]
        assert starting, "the replacement should be starting"
        await pool.aclose()
        assert survivors(starting) == []

    run(main())


# ---------------------------------------------------------------------- env exits (8)
@pytest.mark.parametrize("action", ["sysexit", "kbint"])
def test_systemexit_and_keyboardinterrupt_fail_only_their_episode(action: str):
    async def main():
        async with EnvPool(HOSTILE, num_workers=1) as pool:
            a, b = await pool.reset(seed=0), await pool.reset(seed=1)
            broken = await pool.step(a.episode, action)
            assert broken.reason == "env_error"
            assert ("SystemExit" if action == "sysexit" else "KeyboardInterrupt") in broken.detail
            assert not (await pool.step(b.episode, "fine")).failed
            assert pool.stats().worker_restarts == 0

    run(main())


def test_a_worker_killed_by_a_realtime_signal_is_reported_as_crashed():
    async def main():
        async with EnvPool(HOSTILE, num_workers=1, step_timeout_s=300) as pool:
            ep = await pool.reset(seed=0)
            crashed = await pool.step(ep.episode, "rtsig")
            assert crashed.reason == "worker_crashed"
            assert "signal 40" in crashed.detail

    run(main(), timeout=30)


# ---------------------------------------------------------------------- big answers (7)
def test_an_answer_over_the_size_limit_fails_its_episode_and_names_the_limit():
    async def main():
        async with EnvPool(HOSTILE, num_workers=1, max_message_bytes=1 << 20) as pool:
            a, b = await pool.reset(seed=0), await pool.reset(seed=1)
            big = await pool.step(a.episode, f"big:{2 << 20}")
            assert big.reason == "env_error" and "max_message_bytes" in big.detail
            assert len((await pool.step(b.episode, f"big:{512 << 10}")).observation[0]["content"])
            assert pool.stats().worker_restarts == 0

    run(main())


def test_frames_cut_anywhere_come_out_whole_and_an_oversized_one_is_refused_by_its_header():
    """The worker socket's reader: every cut of the stream yields the same frames; a frame
    announced over the limit is refused from its 4-byte header, before any of it is kept."""
    frames = [len(b).to_bytes(4, "little") + b for b in (b"", b"a", b"xyz" * 5000, b"q" * 7)]
    stream = b"".join(frames)
    for piece in (1, 2, 3, 5, 4096, len(stream)):
        reader = FrameReader(limit=1 << 16)
        got = []
        for at in range(0, len(stream), piece):
            got += [bytes(f) for f in reader.feed(stream[at : at + piece])]
        assert got == frames, piece
    with pytest.raises(FrameTooLargeError, match="over the limit of 100 bytes"):
        FrameReader(limit=100).feed((101).to_bytes(4, "little"))
