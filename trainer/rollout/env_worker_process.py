"""An env worker process (``trainer.rollout.env_workers``): its event loop, the engine it
generates through, and the framed socket both sides talk over.

The driver starts ``python -m trainer.rollout.env_worker_process FD [--lockstep]`` with one
end of a socket pair as ``FD`` and its own ``sys.path`` in ``PYTHONPATH``. The first frame
carries ``("init", setup)``: the worker calls ``setup(RemoteEngine)`` and answers ``("ready",)``,
or ``("fatal", traceback)`` and exits. Then:

    driver -> worker   ("play", key, spec, sampling, max_retries)  play_episode in a task
                       ("result", *result) / ("failed", request_id, error)
                       ("stop", [keys])                              no more replays
    worker -> driver   ("generate", *request)                       a whole prompt
                       ("extend", *request)                         only the ids after the
                                                                    episode's last prompt and
                                                                    its generation
                       ("abort", request_id) / ("forget", key)
                       ("done", key, trajectory, failed attempts) / ("error", key, text)
                       ("idle", frames answered, CPU seconds)        lockstep only

Requests and results travel as tuples of their fields (``request_to_wire`` and friends: a
tuple pickles and loads several times faster than a dataclass), a result without the
per-token versions when every token has the result's version (the usual turn). A finished
trajectory's per-token lists travel as machine arrays' bytes (``trajectory_to_wire``): the
driver loads each with one copy instead of one object per token, and the worker, which has
the spare CPU, pays the packing.

The worker exits when the socket closes (its driver closed it or is gone), after cancelling
its episodes and closing its env source.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from trainer.rollout.router import episode_key
from trainer.rollout.trajectory import Trajectory
from trainer.strategies.base import GenerationRequest, GenerationResult

if TYPE_CHECKING:
    from trainer.rollout.env_manager import EnvManager, EnvSource, Sampling
    from trainer.rollout.groups import EpisodeSpec

__all__ = [
    "Channel",
    "RemoteEngine",
    "WorkerSetup",
    "request_from_wire",
    "request_to_wire",
    "result_from_wire",
    "result_to_wire",
    "trajectory_from_wire",
    "trajectory_to_wire",
]

WorkerSetup = Callable[["RemoteEngine"], "tuple[EnvManager, EnvSource]"]
"""Builds a worker's ``EnvManager`` (generating through the given engine) and ``EnvSource``."""

_HEADER = 4  # bytes of a frame's length

_PACKED = {"token_ids": "i", "response_mask": "b", "logprobs": "d", "token_versions": "i"}
"""A trajectory's per-token lists and the ``array`` type each travels as (native byte order:
both ends are on one machine)."""


def request_to_wire(
    kind: str, request: GenerationRequest, prompt_ids: list[int]
) -> tuple[Any, ...]:
    """``(kind, *request's fields)`` with ``prompt_ids`` as its prompt."""
    r = request
    return (
        kind,
        r.request_id,
        prompt_ids,
        r.max_new_tokens,
        r.temperature,
        r.top_p,
        r.stop_token_ids,
    )


def request_from_wire(message: tuple[Any, ...]) -> GenerationRequest:
    return GenerationRequest(*message[1:])


def result_to_wire(result: GenerationResult) -> tuple[Any, ...]:
    """``("result", *result's fields)``; per-token versions only where they differ from the
    result's version (a turn resumed across a weight update)."""
    extra = result.extra
    versions = extra.get("token_versions")
    if versions is not None and versions.count(result.policy_version) == len(versions):
        extra = {k: v for k, v in extra.items() if k != "token_versions"}
    r = result
    return (
        "result",
        r.request_id,
        r.token_ids,
        r.logprobs,
        r.finish_reason,
        r.policy_version,
        extra,
    )


def result_from_wire(message: tuple[Any, ...]) -> GenerationResult:
    return GenerationResult(*message[1:])


def trajectory_to_wire(trajectory: Trajectory) -> tuple[dict[str, Any], dict[str, str]]:
    """The trajectory's attributes with its per-token lists as array bytes (a list that does
    not fit its array type travels as it is), and which ones were packed; per-turn samples
    likewise."""
    state = dict(vars(trajectory))
    packed: dict[str, str] = {}
    for name, code in _PACKED.items():
        try:
            state[name] = array.array(code, state[name]).tobytes()
        except (TypeError, OverflowError):
            continue
        packed[name] = code
    if trajectory.samples:
        state["samples"] = [trajectory_to_wire(sample) for sample in trajectory.samples]
    return state, packed


def trajectory_from_wire(wire: tuple[dict[str, Any], dict[str, str]]) -> Trajectory:
    """The trajectory ``trajectory_to_wire`` sent, equal to the original."""
    state, packed = wire
    for name, code in packed.items():
        values = array.array(code)
        values.frombytes(state[name])
        state[name] = values.tolist()
    if state["samples"]:
        state["samples"] = [trajectory_from_wire(sample) for sample in state["samples"]]
    trajectory = Trajectory.__new__(Trajectory)
    trajectory.__dict__.update(state)
    return trajectory


class Channel(asyncio.Protocol):
    """Length-prefixed pickled frames over a stream socket; ``send`` batches a loop iteration's
    messages into one frame (``flush`` is scheduled once per iteration, or called by hand)."""

    def __init__(
        self,
        on_frame: Callable[[list[tuple[Any, ...]]], None],
        on_lost: Callable[[], None],
        *,
        auto_flush: bool = True,
    ) -> None:
        self._on_frame, self._on_lost, self._auto_flush = on_frame, on_lost, auto_flush
        self._buffer = bytearray()
        self._outbox: list[tuple[Any, ...]] = []
        self._transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # a stream socket's transport
        self.flush()  # what was queued before the connection was made

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        while len(buffer) - start >= _HEADER:
            size = int.from_bytes(buffer[start : start + _HEADER], "little")
            end = start + _HEADER + size
            if len(buffer) < end:
                break
            frame = pickle.loads(buffer[start + _HEADER : end])
            start = end
            self._on_frame(frame)
        del buffer[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._on_lost()

    def send(self, message: tuple[Any, ...]) -> None:
        if self.closed:
            return
        if not self._outbox and self._auto_flush:
            asyncio.get_running_loop().call_soon(self.flush)
        self._outbox.append(message)

    @property
    def pending(self) -> bool:
        """Messages wait to be flushed."""
        return bool(self._outbox)

    def queue(self, message: tuple[Any, ...]) -> None:
        """Send ``message`` in a frame of its own once connected (before anything else)."""
        self._outbox.append(message)
        if self._transport is not None:
            self.flush()

    def flush(self) -> bool:
        """Write the queued messages as one frame; False when there were none."""
        if not self._outbox or self._transport is None or self.closed:
            return False
        payload = pickle.dumps(self._outbox, protocol=pickle.HIGHEST_PROTOCOL)
        self._outbox = []
        self._transport.write(len(payload).to_bytes(_HEADER, "little") + payload)
        return True

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class RemoteEngine:
    """The driver's router as a worker's ``EnvManager`` sees it (``RolloutEngine``)."""

    def __init__(self, worker: _WorkerLoop) -> None:
        self._worker = worker

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        worker = self._worker
        future: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()
        worker.waiting[request.request_id] = future
        key = episode_key(request.request_id)
        prompt = request.prompt_ids
        last = worker.last_turn.get(key)
        worker.last_turn.pop(key, None)
        if last is not None and len(prompt) >= len(last) and prompt[: len(last)] == last:
            # the usual turn of an episode: only the ids after the previous turn's travel
            worker.channel.send(request_to_wire("extend", request, prompt[len(last) :]))
        else:
            worker.channel.send(request_to_wire("generate", request, prompt))
        worker.settle()
        try:
            result = await future
        finally:
            worker.waiting.pop(request.request_id, None)
        if result.finish_reason != "abort":  # what the driver now holds for this episode
            worker.last_turn[key] = prompt + result.token_ids
        return result

    async def abort(self, request_id: str) -> None:
        self._worker.channel.send(("abort", request_id))

    def forget(self, key: str) -> None:
        self._worker.last_turn.pop(key, None)
        self._worker.channel.send(("forget", key))


class _WorkerLoop:
    """A worker process's event loop: plays the episodes the driver sends."""

    def __init__(self, lockstep: bool) -> None:
        self.lockstep = lockstep
        self.channel = Channel(self.on_frame, self.on_lost, auto_flush=not lockstep)
        self.waiting: dict[str, asyncio.Future[GenerationResult]] = {}
        self.last_turn: dict[str, list[int]] = {}
        """Episode key -> its last prompt + generated ids, as the driver holds them."""
        self.manager: EnvManager | None = None
        self.source: EnvSource | None = None
        self.plays: dict[str, asyncio.Task[None]] = {}
        self.stopped: set[str] = set()
        self.lost = asyncio.Event()
        self._owed = 0
        self._cpu_from = 0.0

    def init(self, setup: WorkerSetup) -> None:
        """Build the manager with ``setup``; answer ``ready``, or ``fatal`` and stop."""
        try:
            self.manager, self.source = setup(RemoteEngine(self))
        except BaseException:  # noqa: BLE001 - reported to the driver, which raises it
            self.channel.queue(("fatal", traceback.format_exc()[-4000:]))
            self.channel.close()
            return
        self.channel.queue(("ready",))

    def on_frame(self, frame: list[tuple[Any, ...]]) -> None:
        if frame[0][0] == "init":
            self.init(frame[0][1])
            return
        if self.lockstep:
            if not self._owed:
                self._cpu_from = time.thread_time()
            self._owed += 1
        for message in frame:
            kind = message[0]
            if kind == "result":  # popped now: the episode no longer waits (``settle``)
                result = result_from_wire(message)
                future = self.waiting.pop(result.request_id, None)
                if future is not None and not future.done():
                    future.set_result(result)
            elif kind == "failed":
                future = self.waiting.pop(message[1], None)
                if future is not None and not future.done():
                    future.set_exception(RuntimeError(message[2]))
            elif kind == "play":
                _, key, spec, sampling, max_retries = message
                task = asyncio.get_running_loop().create_task(
                    self.play(key, spec, sampling, max_retries)
                )
                self.plays[key] = task
            elif kind == "stop":
                self.stopped.update(message[1])
        self.settle()

    async def play(self, key: str, spec: EpisodeSpec, sampling: Sampling, retries: int) -> None:
        from trainer.rollout.groups import play_episode

        if self.manager is None or self.source is None:
            raise RuntimeError("an episode arrived before the worker's setup (the init frame)")
        failed: list[Trajectory] = []
        try:
            trajectory = await play_episode(
                self.manager,
                self.source,
                spec,
                sampling,
                max_retries=retries,
                key=key,
                on_failure=failed.append,
                stop=lambda: key in self.stopped,
            )
        except Exception as error:  # noqa: BLE001 - reported to the driver's scheduler
            self.channel.send(("error", key, f"{type(error).__name__}: {error}"[:500]))
        else:
            self.channel.send(("done", key, trajectory_to_wire(trajectory), failed))
        finally:
            self.plays.pop(key, None)
            self.stopped.discard(key)
            self.settle()

    def settle(self) -> None:
        """lockstep: answer the owed frames once every episode waits for the engine again."""
        if not self.lockstep or not self._owed or len(self.waiting) < len(self.plays):
            return
        self.channel.send(("idle", self._owed, time.thread_time() - self._cpu_from))
        self.channel.flush()
        self._owed = 0

    def on_lost(self) -> None:
        self.lost.set()

    async def serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        await loop.connect_accepted_socket(lambda: self.channel, sock)
        try:
            await self.lost.wait()
        finally:
            for task in list(self.plays.values()):
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    asyncio.gather(*self.plays.values(), return_exceptions=True), 10
                )
            if self.source is not None:
                with contextlib.suppress(Exception):
                    await self.source.aclose()


def main(argv: list[str]) -> None:
    """A worker process: play episodes until the driver's socket closes."""
    from envhub.gc_tuning import relax_gc

    relax_gc()  # as the driver does: many in-flight objects, few cycles
    sock = socket.socket(fileno=int(argv[0]))

    async def main() -> None:
        await _WorkerLoop(lockstep="--lockstep" in argv).serve(sock)

    asyncio.run(main())


if __name__ == "__main__":
    main(sys.argv[1:])
