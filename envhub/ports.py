"""The listening socket of a command that serves (``envhub serve``, ``envhub view``).

Bound before the command says it is serving: a port in use is one error naming the fix, not a
"serving" line followed by the web server's own error (and exit code).
"""

from __future__ import annotations

import socket

from envhub.errors import EnvhubError

__all__ = ["listen"]


def listen(host: str, port: int, backlog: int = 512) -> socket.socket:
    """A listening TCP socket on ``host`` (a name, an IPv4 or an IPv6 address) and ``port``;
    connections queue from here on, before the server has started. ``EnvhubError`` naming the
    address and the fix when it cannot bind (a port in use, a host this machine does not have)."""
    try:
        family, kind, protocol, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
        )[0]
        sock = socket.socket(family, kind, protocol)
    except OSError as error:
        raise EnvhubError(
            f"cannot listen on {host}:{port} ({error}); pick another --host"
        ) from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as error:
        sock.close()
        raise EnvhubError(
            f"cannot listen on {host}:{port} ({error}); pick another --port"
        ) from None
    return sock
