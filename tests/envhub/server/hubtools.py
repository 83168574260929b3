"""Helpers for hub tests: a real uvicorn hub in a thread, raw WebSocket clients, a TCP proxy that
drops connections."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson

from tests.envhub.pool.faulty_envs import register as register_test_envs
from tests.envhub.pool.raycluster import free_port

TOKEN = "test-token-123456"


class RunningHub:
    def __init__(self, app: Any, port: int, server: Any, thread: threading.Thread) -> None:
        self.app, self.port, self.server, self.thread = app, port, server, thread
        self.hub = app.state.hub
        self.url = f"ws://127.0.0.1:{port}"
        self.http = f"http://127.0.0.1:{port}"

    def call(self, coro_fn: Any, timeout: float = 10) -> Any:
        """Run ``coro_fn()`` on the hub's event loop (to inspect state safely)."""
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout)


@contextlib.contextmanager
def running_hub(port: int | None = None, **settings: Any) -> Iterator[RunningHub]:
    """A hub (``create_app`` + uvicorn as ``envhub serve`` configures it) on loopback, on
    ``port`` (a free one by default; pass the last hub's port to restart it there)."""
    import asyncio

    import uvicorn

    from envhub.server.app import create_app
    from envhub.server.cli import uvicorn_config
    from envhub.server.config import HubConfig

    register_test_envs()
    settings.setdefault("token", TOKEN)
    settings.setdefault("workers", 1)
    config = HubConfig(**settings)
    app = create_app(config)
    port = port or free_port()
    server = uvicorn.Server(uvicorn_config(app, port=port))
    holder: dict[str, Any] = {}

    def serve() -> None:
        loop = asyncio.new_event_loop()
        holder["loop"] = loop
        loop.run_until_complete(server.serve())
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.05)
    if not server.started:
        raise RuntimeError("the test hub did not start")
    hub = RunningHub(app, port, server, thread)
    hub.loop = holder["loop"]
    try:
        yield hub
    finally:
        server.should_exit = True
        thread.join(30)


def raw_connect(hub: RunningHub, token: str | None = TOKEN, **kwargs: Any) -> Any:
    from websockets.sync.client import connect

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return connect(
        f"{hub.url}/v1/session",
        additional_headers=headers,
        compression=None,
        open_timeout=10,
        **kwargs,
    ).__enter__()


def ask(ws: Any, message: Any, timeout: float = 10) -> dict[str, Any]:
    # json: ints past 64 bits too
    ws.send(message if isinstance(message, (str, bytes)) else json.dumps(message))
    return orjson.loads(ws.recv(timeout=timeout))


def slow_client(port: int, first_bytes: bytes = b"") -> socket.socket:
    """A raw TCP connection to the hub that sends ``first_bytes`` and then nothing more."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if first_bytes:
        sock.sendall(first_bytes)
    return sock


def closed_by_server(sock: socket.socket, within: float) -> bytes | None:
    """What the hub sent before closing ``sock`` (EOF or reset), or ``None`` if it was still open
    after ``within`` s.

    The deadline bounds a wait for a state change; it is not a timing assertion.
    """
    received = b""
    deadline = time.monotonic() + within
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return None
        except OSError:  # reset by the hub
            return received
        if not chunk:
            return received
        received += chunk


class DropProxy:
    """A loopback TCP proxy whose connections a test can cut, optionally eating bytes first.

    ``eat("up")`` swallows the next chunk from client to hub and then cuts the connection
    (the request never arrives); ``eat("down")`` swallows the next chunk from hub to client
    and cuts (the answer is lost after the hub applied the request). ``cut()`` resets every
    live connection at once.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.eating: str | None = None
        self.connections = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self.lock:
                self.pairs.append((client, upstream))
                self.connections += 1
            threading.Thread(target=self._pump, args=(client, upstream, "up"), daemon=True).start()
            threading.Thread(
                target=self._pump, args=(upstream, client, "down"), daemon=True
            ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            if self.eating == direction:
                self.eating = None
                self.cut()
                return
            try:
                dst.sendall(data)
            except OSError:
                return

    def eat(self, direction: str) -> None:
        self.eating = direction

    def cut(self) -> None:
        """Reset every connection (RST, like a crashed NAT or a dead link)."""
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for pair in pairs:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                    )
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the pump thread blocked in recv()
                with contextlib.suppress(OSError):
                    sock.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes accept(); new connects are refused
        self.listener.close()
        self.cut()


__all__ = [
    "TOKEN",
    "DropProxy",
    "RunningHub",
    "ask",
    "closed_by_server",
    "free_port",
    "raw_connect",
    "running_hub",
    "slow_client",
]


@contextlib.contextmanager
def envhub_serve(
    *args: str, token: str = TOKEN, preexec_fn: Any = None, env: dict[str, str] | None = None
) -> Iterator[tuple[Any, int]]:
    """A real ``envhub serve`` process on a free port, up and healthy; killed on exit.

    ``preexec_fn`` runs in the child before it starts (e.g. to lower its open-file limit);
    ``env`` replaces its environment (default: this process's).
    """
    import subprocess
    import sys

    import httpx

    port = free_port()
    command = [
        sys.executable,
        "-m",
        "envhub.cli",
        "serve",
        *args,
        "--port",
        str(port),
        "--token",
        token,
    ]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=preexec_fn,  # noqa: PLW1509 - tests pass only resource.setrlimit (no locks)
        env=env,
    )
    deadline = time.monotonic() + 90
    try:
        while True:
            if proc.poll() is not None:
                output = proc.stdout.read()  # type: ignore[union-attr]
                raise RuntimeError(f"envhub serve exited with {proc.returncode}:\n{output}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("envhub serve did not become healthy in 90 s")
            time.sleep(0.2)
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


__all__ += ["envhub_serve"]
