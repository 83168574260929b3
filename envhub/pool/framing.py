"""The process worker's wire: length-prefixed binary frames over a socketpair.

::

    request  = u32 length | u32 request id | u8 op | u64 episode | body
    response = u32 length | u32 request id | u8 status | body (JSON)

``length`` counts the bytes after itself. ``FrameReader`` cuts a byte stream into frames in
linear time: a frame that arrives in pieces is copied once into a buffer of its announced size
(not re-joined on every read), and a frame announced over the reader's limit is refused before
any of it is buffered (a runaway env must not make its parent allocate gigabytes).
"""

from __future__ import annotations

import struct

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "REQUEST",
    "RESPONSE",
    "FrameReader",
    "FrameTooLargeError",
]

REQUEST = struct.Struct("<IIBQ")  # length (of what follows), request id, op, episode
RESPONSE = struct.Struct("<IIB")  # length (of what follows), request id, status
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
"""The largest answer (JSON of one reset or step) a worker sends: 64 MiB."""


class FrameTooLargeError(ValueError):
    """A frame announced more bytes than the reader accepts."""


class FrameReader:
    """Whole frames (length prefix included) out of the chunks a socket delivers."""

    def __init__(self, limit: int | None = None) -> None:
        """``limit``: the largest ``length`` accepted (None: any)."""
        self.limit = limit
        self._head = b""  # the first bytes of a frame whose length is not in yet (< 4)
        self._frame: bytearray | None = None  # the frame being filled, at its full size
        self._filled = 0

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes | bytearray | memoryview]:
        """The frames ``data`` completes, in order; raises ``FrameTooLargeError``. A frame that
        came whole in ``data`` is a view of it (no copy): use it before ``data`` is reused."""
        frames: list[bytes | bytearray | memoryview] = []
        view = memoryview(data)
        pos, end = 0, len(data)
        if self._head:  # join the few header bytes left over (at most 3)
            need = 4 - len(self._head)
            joined = self._head + bytes(view[:need])
            pos = len(joined) - len(self._head)
            self._head = b""
            if len(joined) < 4:
                self._head = joined
                return frames
            frame = self._start(int.from_bytes(joined, "little"))
            frame[:4] = joined
            self._filled = 4
            if len(frame) == 4:  # (an empty frame)
                frames.append(frame)
                self._frame = None
        while pos < end:
            if self._frame is not None:  # filling a frame that came cut
                take = min(len(self._frame) - self._filled, end - pos)
                self._frame[self._filled : self._filled + take] = view[pos : pos + take]
                self._filled += take
                pos += take
                if self._filled == len(self._frame):
                    frames.append(self._frame)
                    self._frame = None
                continue
            if end - pos < 4:
                self._head = bytes(view[pos:end])
                break
            length = int.from_bytes(view[pos : pos + 4], "little")
            self._check(length)
            stop = pos + 4 + length
            if stop <= end:  # whole in this chunk: no copy
                frames.append(view[pos:stop])
                pos = stop
                continue
            self._start(length)
            continue
        return frames

    def _check(self, length: int) -> None:
        if self.limit is not None and length > self.limit:
            raise FrameTooLargeError(
                f"a frame of {length} bytes is over the limit of {self.limit} bytes"
            )

    def _start(self, length: int) -> bytearray:
        self._check(length)
        self._frame = bytearray(4 + length)
        self._filled = 0
        return self._frame
