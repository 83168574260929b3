"""``trainer.rollout.wire``: what crosses between env workers and the driver - requests,
results and finished trajectories (packed, counted without unpacking) - and ``Channel``'s
framing, whole and in order however the socket splits it, and never delivered twice."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import socket
from typing import Any

import pytest

from trainer.strategies.base import GenerationResult


def test_a_turn_resumed_across_a_weight_update_keeps_its_token_versions_over_the_wire() -> None:
    from trainer.rollout.trajectory import Trajectory
    from trainer.rollout.wire import result_from_wire, result_to_wire

    def through_the_wire(versions: list[int], version: int) -> list[int]:
        result = GenerationResult("ep/0", [5, 6, 7], [-0.1] * 3, "stop", version)
        result.extra["token_versions"] = versions
        trajectory = Trajectory("env", 0, 0)
        trajectory.append_generation(result_from_wire(result_to_wire(result)))
        return trajectory.token_versions

    assert through_the_wire([3, 3, 4], 4) == [3, 3, 4]  # preempted at version 3, resumed at 4
    assert through_the_wire([4, 4, 4], 4) == [4, 4, 4]  # the usual turn: sent without them


def test_a_finished_trajectory_crosses_the_wire_unchanged() -> None:
    from trainer.rollout.trajectory import Trajectory
    from trainer.rollout.wire import trajectory_from_wire, trajectory_to_wire

    episode = Trajectory("env", 3, 1, messages=[{"role": "user", "content": "hi"}])
    episode.append_context([1, 2, 3])
    episode.append_generation(GenerationResult("ep/0", [7, 8], [-0.25, -1e-30], "stop", 2))
    episode.turn_rewards, episode.turn_ends, episode.success = [1.0], [4], True
    turn = episode.turn_sample([1, 2, 3])
    turn.append_policy([7, 8], [-0.25, -0.5], 2)
    episode.samples.append(turn)
    huge = Trajectory("env", 4, 1)
    huge.append_policy([2**40, 5], [-0.5, -0.5], 1)  # an id no 32-bit array holds: sent as is

    for original in (episode, huge):
        loaded = trajectory_from_wire(pickle.loads(pickle.dumps(trajectory_to_wire(original))))
        assert loaded == original
        assert type(loaded.token_ids) is list and type(loaded.logprobs[0]) is float


def test_a_trajectory_from_the_wire_counts_without_unpacking_and_stays_right_when_changed() -> None:
    """The driver reads a finished episode's counts (oldest version, tokens) for every group,
    trained or dropped: they come packed with it, and stay exact once its lists change."""
    import copy

    from trainer.rollout.trajectory import Trajectory
    from trainer.rollout.wire import trajectory_from_wire, trajectory_to_wire

    original = Trajectory("env", 3, 1, messages=[{"role": "user", "content": "hi"}])
    original.append_context([1, 2, 3])
    original.append_generation(
        GenerationResult("ep/0", [7, 8], [-0.5, -0.5], "stop", 4, {"token_versions": [3, 4]})
    )
    loaded = trajectory_from_wire(pickle.loads(pickle.dumps(trajectory_to_wire(original))))
    counts = (loaded.oldest_version, loaded.num_policy_tokens, loaded.num_tokens)
    assert counts == (3, 2, 5)
    assert "token_ids" not in vars(loaded)  # still packed: nothing unpacked to count
    assert "messages" not in vars(loaded)  # the transcript too, until someone reads it
    twin = copy.copy(loaded)
    assert twin.token_versions == [-1, -1, -1, 3, 4]  # a copy unpacks on its own
    assert loaded == original

    loaded.append_policy([9], [-0.5], 2)  # an older version's token, appended after arrival
    assert (loaded.oldest_version, loaded.num_policy_tokens, loaded.num_tokens) == (2, 3, 6)
    replaced = trajectory_from_wire(trajectory_to_wire(original))
    replaced.token_versions = [-1, -1, -1, 1, 1]  # assigned without reading: counts follow
    assert replaced.oldest_version == 1
    assert (twin.oldest_version, pickle.loads(pickle.dumps(loaded)).num_tokens) == (3, 6)
    changed = dataclasses.replace(replaced, final_reward=2.0)  # a new one, built from the lists
    assert (changed.oldest_version, changed.num_tokens, changed.final_reward) == (1, 5, 2.0)


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_frames_arrive_whole_and_in_order_however_the_socket_splits_them(chunk: int) -> None:
    """The wire's framing: frames split across reads at any byte, several in one read, and
    frames larger than the channel's read buffer all reach the handler whole, in order."""
    from trainer.rollout.wire import Channel

    frames = [[("small", i)] for i in range(3)]
    frames += [[("big", bytes(range(256)) * 1000)], [("after", None)], [("x", "y" * 70_000)]]
    stream = b"".join(len(p).to_bytes(4, "little") + p for p in (pickle.dumps(f) for f in frames))
    got: list[Any] = []
    channel = Channel(got.append, lambda: None)
    at = 0
    while at < len(stream):
        room = channel.get_buffer(-1)
        n = min(chunk, len(room), len(stream) - at)
        room[:n] = stream[at : at + n]
        channel.buffer_updated(n)  # (asyncio still holds the buffer it read into meanwhile)
        del room
        at += n
    assert got == frames


def _frame(*message: Any) -> bytes:
    payload = pickle.dumps([message])
    return len(payload).to_bytes(4, "little") + payload


def test_a_frame_whose_handler_failed_is_not_delivered_again() -> None:
    """A handler that raises on one frame of a read: the frames before it were handled and are
    never handed over again, the frames after it still come, in order, with the next read."""
    from trainer.rollout.wire import Channel

    got: list[str] = []

    def handle(frame: list[tuple[Any, ...]]) -> None:
        got.append(frame[0][0])
        if frame[0][0] == "B":
            raise KeyError("a bug in the handler")

    channel = Channel(handle, lambda: None)

    def receive(data: bytes) -> None:
        while data:
            room = channel.get_buffer(-1)
            n = min(len(room), len(data))
            room[:n], data = data[:n], data[n:]
            del room
            channel.buffer_updated(n)

    with pytest.raises(KeyError) as failed:
        receive(_frame("A") + _frame("B") + _frame("C"))
    receive(_frame("D", b"x" * 300_000))  # the buffer grows: no view of it was kept
    assert got == ["A", "B", "C", "D"] and failed.traceback


@pytest.mark.parametrize("bad", ["handler", "frame"])
def test_a_socket_channel_whose_frame_fails_closes_instead_of_looping(bad: str) -> None:
    """On a socket served by ``attach_socket`` (the relayed engines' channels), a frame that
    cannot be read or whose handler fails ends the connection, as asyncio's own transports do:
    the peer is told (its end closes), ``on_lost`` runs, nothing is delivered twice and the
    channel does not keep reading a stream it can no longer trust."""
    from trainer.rollout.wire import Channel, attach_socket

    async def run() -> tuple[list[str], list[str]]:
        loop = asyncio.get_running_loop()
        logged: list[str] = []
        loop.set_exception_handler(lambda _, context: logged.append(repr(context["exception"])))
        got: list[str] = []
        lost = loop.create_future()

        def handle(frame: list[tuple[Any, ...]]) -> None:
            got.append(frame[0][0])
            if frame[0][0] == "B" and bad == "handler":
                raise KeyError("a bug in the handler")

        mine, theirs = socket.socketpair()
        channel = Channel(handle, lambda: lost.set_result(None))
        attach_socket(channel, mine)
        broken = b"\x05\x00\x00\x00junk!" if bad == "frame" else _frame("B")
        theirs.sendall(_frame("A") + broken + _frame("C"))
        await asyncio.wait_for(lost, 30)
        theirs.setblocking(False)
        assert await asyncio.wait_for(loop.sock_recv(theirs, 1), 30) == b""  # closed
        theirs.close()
        return got, logged

    got, logged = asyncio.run(run())
    assert got == (["A", "B"] if bad == "handler" else ["A"])
    assert len(logged) == 1 and ("KeyError" if bad == "handler" else "Unpickling") in logged[0]
