"""The wire between the driver and its env worker processes (``trainer.rollout.env_workers``):
length-prefixed pickled frames over a stream socket, and the messages' encodings.

Requests and results travel as tuples of their fields (``request_to_wire`` and friends: a
tuple pickles and loads several times faster than a dataclass), a result without the
per-token versions when every token has the result's version (the usual turn). A finished
trajectory's per-token lists travel as machine arrays' bytes (``trajectory_to_wire``): the
driver loads each with one copy instead of one object per token, and the worker, which has
the spare CPU, pays the packing; its transcript (``messages``) travels pickled on its own, one
bytes object until read. Both ends are processes of one machine that trust each other
(a socket pair, never a network port), so frames are pickled.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import pickle
import socket
import types
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any, cast

from trainer.rollout.trajectory import Counts, Trajectory
from trainer.strategies.base import GenerationRequest, GenerationResult

__all__ = [
    "Channel",
    "PackedTrajectory",
    "attach_socket",
    "request_from_wire",
    "request_to_wire",
    "result_from_wire",
    "result_to_wire",
    "trajectory_from_wire",
    "trajectory_to_wire",
]

_HEADER = 4  # bytes of a frame's length

_PACKED = {"token_ids": "i", "response_mask": "b", "logprobs": "d", "token_versions": "i"}
"""A trajectory's per-token lists and the ``array`` type each travels as (native byte order:
both ends are on one machine)."""
_PICKLED = "pickle"
"""The type code of a packed attribute that travels pickled on its own (the transcript: dozens
of objects per episode that the driver rarely reads, left as one bytes object until read)."""
_LAZY = ("messages",)
"""The attributes that travel so (``_PICKLED``)."""
_COUNTED_FROM = ("token_ids", "response_mask", "token_versions")
"""The lists a packed trajectory's counts stand for."""


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


TrajectoryWire = tuple[dict[str, Any], dict[str, str], Counts]
"""A trajectory's attributes, which of them travel packed (name -> array type code), and
its own counts."""


def trajectory_to_wire(trajectory: Trajectory) -> TrajectoryWire:
    """The trajectory's attributes with its per-token lists as array bytes (a list that does
    not fit its array type travels as it is) and its transcript pickled apart, which ones were
    packed and its counts (the sender, a worker with CPU to spare, counts); per-turn samples
    likewise."""
    state = {k: v for k, v in vars(trajectory).items() if not k.startswith("_")}
    for name in (*_PACKED, *_LAZY):  # read, not copied: a PackedTrajectory's are in _packed
        state[name] = getattr(trajectory, name)
    packed: dict[str, str] = {}
    for name in _LAZY:
        state[name] = pickle.dumps(state[name], protocol=pickle.HIGHEST_PROTOCOL)
        packed[name] = _PICKLED
    for name, code in _PACKED.items():
        try:
            state[name] = array.array(code, state[name]).tobytes()
        except (TypeError, OverflowError):
            continue
        packed[name] = code
    if trajectory.samples:
        state["samples"] = [trajectory_to_wire(sample) for sample in trajectory.samples]
    counts = (trajectory._oldest(), sum(trajectory.response_mask), len(trajectory.token_ids))
    return state, packed, counts


def trajectory_from_wire(wire: TrajectoryWire) -> Trajectory:
    """The trajectory ``trajectory_to_wire`` sent, equal to the original; its per-token lists
    stay packed until first read (``PackedTrajectory``)."""
    state, packed, counted = wire
    lists = {name: (code, state.pop(name)) for name, code in packed.items()}
    if state["samples"]:
        state["samples"] = [trajectory_from_wire(sample) for sample in state["samples"]]
    trajectory = PackedTrajectory.__new__(PackedTrajectory)
    trajectory.__dict__.update(state, _packed=lists, _counts=counted)
    return trajectory


class PackedTrajectory(Trajectory):
    """A finished trajectory from an env worker whose per-token lists and transcript stay
    packed until first read, the worker's counts answering the scheduler meanwhile: the
    driver pays nothing for the episodes it never trains on (a surplus or stale group's).
    Reading or assigning a list unpacks or replaces it, and the counts then come from the lists
    again. Equal to the ``Trajectory`` it was sent as."""

    _packed: Mapping[str, tuple[str, bytes]] = types.MappingProxyType({})
    """Name -> array type code (or ``_PICKLED``) and bytes (kept once unpacked: a copy shares
    them); none in one built from lists (``dataclasses.replace``)."""
    _counts: Counts

    def __getattr__(self, name: str) -> Any:
        """Only asked for what the instance does not hold: a list or transcript still packed is
        unpacked."""
        packed = self.__dict__.get("_packed")
        if packed is None or name not in packed:
            raise AttributeError(f"'PackedTrajectory' object has no attribute {name!r}")
        code, data = packed[name]
        value = pickle.loads(data) if code == _PICKLED else _load(code, data).tolist()
        self.__dict__[name] = value
        return value

    def token_array(self, name: str) -> array.array[Any]:
        """A list still packed: its array, from the bytes in one copy (no Python objects)."""
        packed = self._packed.get(name)
        if packed is None or name in self.__dict__:
            return super().token_array(name)
        return _load(*packed)

    def _counted(self) -> Counts | None:
        state, packed = self.__dict__, self._packed
        if all(name in packed and name not in state for name in _COUNTED_FROM):
            return self._counts
        return None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trajectory):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in fields(Trajectory))

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass


def _load(code: str, data: bytes) -> array.array[Any]:
    """A packed list's array (one copy of its bytes)."""
    values = array.array(code)
    values.frombytes(data)
    return values


class Channel(asyncio.BufferedProtocol):
    """Length-prefixed pickled frames over a stream socket; ``send`` batches a loop iteration's
    messages into one frame (``flush`` is scheduled once per iteration, or called by hand).

    A buffered protocol: the loop reads straight into the channel's buffer (``recv_into``),
    which grows to hold the frame being read, and each frame is unpickled from the buffer in
    place: no bytes are copied between the socket and ``pickle`` (a driver reads megabytes of
    finished episodes a second), and no read buffer is allocated per read."""

    _read_size = 1 << 16

    def __init__(
        self,
        on_frame: Callable[[list[tuple[Any, ...]]], None],
        on_lost: Callable[[], None],
        *,
        auto_flush: bool = True,
    ) -> None:
        self._on_frame, self._on_lost, self._auto_flush = on_frame, on_lost, auto_flush
        self._buffer = bytearray(self._read_size)
        self._filled = 0  # bytes of the buffer read and not yet handled
        self._wanted = 0  # the end of the frame being read, once its header is in
        self._outbox: list[tuple[Any, ...]] = []
        self._transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # a stream socket's transport
        self.flush()  # what was queued before the connection was made

    def get_buffer(self, sizehint: int) -> memoryview:
        """The buffer's free part (grown here, the only place nothing else holds a view of it:
        the loop keeps this one until ``buffer_updated`` returns)."""
        need = max(self._wanted, self._filled + self._read_size)
        if not self._filled and len(self._buffer) > 16 * self._read_size:
            self._buffer = bytearray(need)  # a big frame came and went: give its room back
        elif len(self._buffer) < need:
            self._buffer.extend(bytes(need - len(self._buffer)))
        return memoryview(self._buffer)[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        """Hand each whole frame read to ``on_frame``. A frame that cannot be unpickled, or
        whose handler raises, counts as read: the error propagates (a socket's reader then
        closes the connection) and no frame is ever handed over twice."""
        self._filled += nbytes
        filled, start, wanted = self._filled, 0, 0
        with memoryview(self._buffer) as view:
            try:
                while filled - start >= _HEADER:
                    size = int.from_bytes(view[start : start + _HEADER], "little")
                    end = start + _HEADER + size
                    if filled < end:
                        wanted = end - start  # its end once moved to the front
                        break
                    begin, start = start + _HEADER, end  # read, whatever comes of it
                    self._on_frame(pickle.loads(view[begin:end]))  # (no view kept: see get_buffer)
            finally:
                if start:  # what follows the last frame read moves to the front (same size)
                    view[: filled - start] = view[start:filled]
                self._filled, self._wanted = filled - start, wanted

    def data_received(self, data: bytes | memoryview) -> None:
        """Bytes that did not come through ``get_buffer`` (e.g. a plain ``Protocol`` user)."""
        at = 0
        while at < len(data):
            with self.get_buffer(-1) as room:
                n = min(len(room), len(data) - at)
                room[:n] = data[at : at + n]
            self.buffer_updated(n)
            at += n

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

    def take_pending(self) -> list[tuple[Any, ...]]:
        """The queued messages, taken out (to travel in another channel's frame)."""
        out, self._outbox = self._outbox, []
        return out

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def attach_socket(
    channel: Channel,
    sock: socket.socket,
    off_clock: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> None:
    """Serve ``channel`` on ``sock`` with the loop's reader and writer callbacks, every read,
    write and frame handled inside ``off_clock()`` (asyncio's own transports read outside any
    callback of ours): the cluster simulation's relayed engines' traffic stays off the
    driver's clock that way (``trainer.rollout.worker_routing``)."""
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    pending = bytearray()

    def read() -> None:
        with off_clock():
            try:
                size = sock.recv_into(channel.get_buffer(-1))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                size = 0
            if not size:
                close()
                return
            try:
                channel.buffer_updated(size)
            except BaseException:  # a frame that failed: the stream is not trusted any more
                close()
                raise

    def drain() -> None:
        with off_clock():
            try:
                sent = sock.send(pending)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                close()
                return
            del pending[:sent]
            if not pending:
                loop.remove_writer(sock)

    class _Writer:
        def write(self, data: bytes) -> None:
            if channel.closed:
                return
            if not pending:
                with off_clock():
                    try:
                        sent = sock.send(data)
                    except (BlockingIOError, InterruptedError):
                        sent = 0
                    except OSError:
                        close()
                        return
                if sent == len(data):
                    return
                data = data[sent:]
                loop.add_writer(sock, drain)
            pending.extend(data)

        def close(self) -> None:
            close()

    def close() -> None:
        if channel.closed:
            return
        loop.remove_reader(sock)
        loop.remove_writer(sock)
        sock.close()
        channel.connection_lost(None)

    loop.add_reader(sock, read)
    channel.connection_made(cast(asyncio.BaseTransport, _Writer()))
