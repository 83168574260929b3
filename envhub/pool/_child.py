"""The main loop of a process worker: ``python -m envhub.pool._child FD``.

The parent passes one end of a socketpair as ``FD``. The first frame is the pickled
``(env, env_kwargs)`` to host; every later frame is a request (see ``envhub.pool.local``
for the framing). Requests that arrive together are answered together in one write, so
the per-step cost is a few microseconds of decoding and one env call. The child dies with
its parent (``PR_SET_PDEATHSIG``) and when the socket closes.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import struct
import sys

_REQ = struct.Struct("<IIBI")  # length (of what follows), request id, op, episode
_RESP = struct.Struct("<IIB")  # length (of what follows), request id, status


def _die_with_parent() -> None:
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001, S110 - not Linux: the closed socket still ends the loop
        pass


def main(fd: int) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C drains the server; it stops us
    sock = socket.socket(fileno=fd)
    from envhub.pool.base import STATUS_ENV_ERROR, STATUS_OK, dumps
    from envhub.pool.host import EnvHost, spec_factory

    buf = bytearray()
    host: EnvHost | None = None
    handle = None
    pack = _RESP.pack
    unpack_from = _REQ.unpack_from
    hsize = _REQ.size
    while True:
        data = sock.recv(1 << 20)
        if not data:
            break
        if buf:  # the rest of a frame that came cut
            buf += data
            data = bytes(buf)
            buf.clear()
        out: list[bytes] = []
        pos, end = 0, len(data)
        while end - pos >= hsize:
            length, req_id, op, episode = unpack_from(data, pos)
            stop = pos + 4 + length
            if stop > end:
                break
            body = data[pos + hsize : stop]
            pos = stop
            if handle is None:  # the setup frame
                try:
                    env, env_kwargs = pickle.loads(body)
                    host = EnvHost(spec_factory(env, env_kwargs))
                    host.idle.append(host.factory())  # fail fast on a bad env, reuse it later
                    status, result = STATUS_OK, dumps({"pid": os.getpid()})
                    handle = host.handle
                except BaseException as exc:  # noqa: BLE001 - report, then exit: the parent raises
                    import traceback

                    status, result = (
                        STATUS_ENV_ERROR,
                        dumps({"error": type(exc).__name__, "message": traceback.format_exc()}),
                    )
                out.append(pack(5 + len(result), req_id, status))
                out.append(result)
                if handle is None:
                    sock.sendall(b"".join(out))
                    return
                continue
            status, result = handle(op, episode, body)
            out.append(pack(5 + len(result), req_id, status))
            out.append(result)
        if pos < end:
            buf += memoryview(data)[pos:]
        if out:
            sock.sendall(b"".join(out))
    if host is not None:
        host.close()


if __name__ == "__main__":
    main(int(sys.argv[1]))
