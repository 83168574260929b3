"""``VirtualClockLoop``: simulated waits take no real time, threads are waited for, and the
simulation's own bookkeeping is kept off the clock."""

from __future__ import annotations

import asyncio
import threading

from trainer.rollout import sim_clock


def test_a_long_sleep_is_jumped_over_and_timeouts_fire_in_simulated_time() -> None:
    async def main() -> tuple[float, float, str, float]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, sim_clock.VirtualClockLoop)
        start = loop.time()
        await asyncio.sleep(3600)
        slept = loop.time() - start
        try:
            await asyncio.wait_for(asyncio.Event().wait(), 600)
            outcome = "answered"
        except TimeoutError:
            outcome = "timed out"
        return slept, loop.time() - start, outcome, loop.skipped_s

    slept, total, outcome, skipped = sim_clock.run(main())
    assert slept >= 3600 and total >= 4200 and outcome == "timed out"
    assert skipped > 4199  # jumped over, not waited for


def test_timers_fire_in_order_of_their_simulated_deadlines() -> None:
    async def main() -> list[int]:
        order: list[int] = []

        async def after(seconds: float, tag: int) -> None:
            await asyncio.sleep(seconds)
            order.append(tag)

        await asyncio.gather(*(after(s, s) for s in (50, 10, 30, 20, 40)))
        return order

    assert sim_clock.run(main()) == [10, 20, 30, 40, 50]


def test_the_clock_does_not_jump_past_a_thread_that_has_not_answered() -> None:
    release = threading.Event()

    async def main() -> tuple[bool, str]:
        # a timer far ahead: jumping to it would be wrong while the thread still works
        far = asyncio.ensure_future(asyncio.sleep(1000))
        worker = asyncio.ensure_future(asyncio.to_thread(release.wait, 60))
        asyncio.get_running_loop().call_soon(release.set)
        done, _ = await asyncio.wait({far, worker}, return_when=asyncio.FIRST_COMPLETED)
        far.cancel()
        return worker in done, "thread first" if far not in done else "timer first"

    answered, first = sim_clock.run(main())
    assert answered and first == "thread first"


def test_uncharged_work_leaves_the_clock_where_it_was() -> None:
    async def main() -> tuple[float, float, float]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, sim_clock.VirtualClockLoop)
        with loop.uncharged():
            before = loop.time()
            sum(i * i for i in range(200_000))  # CPU work of the simulation itself
            during = loop.time()
        return before, during, loop.uncharged_s

    before, during, uncharged = sim_clock.run(main())
    assert during == before and uncharged > 0


def test_stops_of_the_charging_nest_and_the_outermost_one_decides() -> None:
    def burn() -> None:
        sum(i * i for i in range(100_000))

    async def main() -> tuple[float, float, float, float]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, sim_clock.VirtualClockLoop)
        loop.stop_charging()  # the simulated engine's step ...
        before = loop.time()
        loop.stop_charging()  # ... takes a request inside it
        burn()
        inner = loop.start_charging()
        burn()  # still the step's: not on the clock
        outer = loop.start_charging()
        return before, inner, outer, loop.time()

    before, inner, outer, after = sim_clock.run(main())
    assert inner == 0.0 and outer > 0  # the outermost end reports the whole block's CPU
    assert after - before < outer / 2  # ... none of which is on the clock
