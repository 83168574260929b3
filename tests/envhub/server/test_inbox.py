"""``Inbox``, the hub's per-connection queue of received WebSocket messages: what a session reads
arrives whole and in order, and a reader that gives up (a hello timeout, a closed session)
loses no message to the next one."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("uvicorn", reason="the server extra is not installed")

from envhub.server.guard import Inbox


def test_messages_come_out_in_the_order_they_came_in() -> None:
    async def main() -> list[int]:
        inbox = Inbox()
        reader = asyncio.ensure_future(asyncio.gather(*[inbox.get() for _ in range(3)]))
        await asyncio.sleep(0)  # the readers wait
        for i in range(5):
            inbox.put_nowait(i)
        first = await reader
        return [*first, await inbox.get(), await inbox.get()]

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]


def test_a_reader_that_timed_out_leaves_the_next_message_to_the_next_read() -> None:
    async def main() -> object:
        inbox = Inbox()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(inbox.get(), 0.01)
        inbox.put_nowait("hello")
        return await asyncio.wait_for(inbox.get(), 5)

    assert asyncio.run(main()) == "hello"


def test_a_reader_woken_then_cancelled_passes_the_message_to_another_reader() -> None:
    async def main() -> tuple[bool, object]:
        inbox = Inbox()
        first = asyncio.ensure_future(inbox.get())
        second = asyncio.ensure_future(inbox.get())
        await asyncio.sleep(0)  # both wait, first in line
        inbox.put_nowait("only")  # wakes the first...
        first.cancel()  # ...which is cancelled before it runs
        got = await asyncio.wait_for(second, 5)
        return first.cancelled(), got

    assert asyncio.run(main()) == (True, "only")
