"""The main loop of a process worker: ``python -m envhub.pool._child FD``.

The parent passes one end of a socketpair as ``FD``. The first frame is the pickled
``(env, env_kwargs, max_message_bytes)`` to host; every later frame is a request (see
``envhub.pool.framing``). Each request is answered as soon as it is handled, so the parent
times (and, on a hang, blames) the request that is actually running, never one queued behind
it. An answer over ``max_message_bytes`` is replaced (by the host) with an ``env_error`` naming
the limit. The child dies with its parent (``PR_SET_PDEATHSIG``) and when the socket closes.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import sys


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
    from envhub.pool.framing import REQUEST, RESPONSE, FrameReader
    from envhub.pool.host import EnvHost, spec_factory

    reader = FrameReader()
    host: EnvHost | None = None
    pack = RESPONSE.pack
    unpack_from = REQUEST.unpack_from
    hsize = REQUEST.size
    buffer = bytearray(1 << 20)  # reused: recv(1 MiB) would map and unmap a new 1 MiB each time
    view = memoryview(buffer)
    while True:
        size = sock.recv_into(buffer)
        if not size:
            break
        for frame in reader.feed(view[:size]):  # every frame is handled before the next read
            _, req_id, op, episode = unpack_from(frame, 0)
            body = bytes(frame[hsize:])
            if host is None:  # the setup frame
                try:
                    env, env_kwargs, limit = pickle.loads(body)
                    host = EnvHost(spec_factory(env, env_kwargs), max_answer_bytes=limit)
                    host.idle.append(host.factory())  # fail fast on a bad env, reuse it later
                    status, result = STATUS_OK, dumps({"pid": os.getpid()})
                except BaseException as exc:  # noqa: BLE001 - report, then exit: the parent raises
                    import traceback

                    status, result = (
                        STATUS_ENV_ERROR,
                        dumps({"error": type(exc).__name__, "message": traceback.format_exc()}),
                    )
                sock.sendall(pack(5 + len(result), req_id, status) + result)
                if host is None:
                    return
                continue
            status, result = host.handle(op, episode, body)
            sock.sendall(pack(5 + len(result), req_id, status) + result)
    if host is not None:
        host.close()


if __name__ == "__main__":
    main(int(sys.argv[1]))
