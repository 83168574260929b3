"""The ``ray`` worker backend: each worker is a Ray actor hosting many envs.

``EnvPool(..., backend="ray")`` places ``num_workers`` actors on the cluster the driver is
connected to (``ray.init(address=...)`` first; without it a local Ray instance starts).
By default actors take one CPU each and are spread across nodes
(``scheduling_strategy="SPREAD"``); pass ``ray_options`` to change that (``resources``,
``num_cpus``, a placement group). An actor whose process or node dies fails its pending
calls with ``ActorDiedError``: the pool turns its episodes into ``EpisodeFailure`` records
and starts a replacement wherever the cluster has room. A worker that dies while idle is
noticed by the ping the pool sends each idle worker about once a second (not under a
``max_pending_calls`` limit, where a ping would take one of the calls: there the next call
fails as above). As on a process worker, an answer over the pool's ``max_message_bytes`` fails
its episode (``env_error``) in the actor. A call Ray refuses at submit (past
``max_pending_calls``) raises ``EpisodeError`` and leaves the episode as it was. Ray is
imported only here.

Joining a cluster: :func:`connect` (used by ``envhub serve --backend ray --address``) turns
Ray's connection failures into a :class:`RayConnectError` that names the fix. The common one:
``ray start --head`` turns on token authentication whenever a token exists (``~/.ray/auth_token``,
which any earlier local ``ray.init()`` writes), and a process that joins by an explicit
``host:port`` sends no token unless ``RAY_AUTH_MODE=token`` is set. (The head also advertises
the machine's interface address even when started with ``--node-ip-address 127.0.0.1``; Ray
follows that itself once the token is accepted.)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
from typing import Any

from envhub.errors import describe_error
from envhub.pool.base import OP_PING
from envhub.pool.errors import RayConnectError, WorkerStartError
from envhub.pool.framing import DEFAULT_MAX_MESSAGE_BYTES
from envhub.pool.host import EnvHost, spec_factory
from envhub.pool.local import DeathCallback, WorkerBase

__all__ = ["DEFAULT_RAY_OPTIONS", "RayWorker", "connect"]

DEFAULT_RAY_OPTIONS: dict[str, Any] = {
    "num_cpus": 1,
    "scheduling_strategy": "SPREAD",
    "max_restarts": 0,
}


class RayEnvHost:
    """The actor body: an ``EnvHost`` plus a report of where it runs."""

    def __init__(self, env: Any, env_kwargs: dict[str, Any], max_message_bytes: int) -> None:
        self.host = EnvHost(spec_factory(env, env_kwargs), max_answer_bytes=max_message_bytes)
        self.host.idle.append(self.host.factory())  # fail fast on a bad env

    def where(self) -> dict[str, Any]:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def handle(self, op: int, episode: int, body: bytes) -> tuple[int, bytes]:
        return self.host.handle(op, episode, body)

    def close(self) -> None:
        self.host.close()


def connect(address: str | None) -> None:
    """Join the Ray cluster at ``address`` (``host:port`` or ``auto``; None: ``RAY_ADDRESS``, else a
    new local Ray). No-op when this process is connected already. Raises :class:`RayConnectError`.

    A ``host:port`` is first probed with one TCP connection (5 s): Ray itself retries an address
    where nothing listens for minutes before it gives up."""
    import ray

    if ray.is_initialized():
        return
    target = address or os.environ.get("RAY_ADDRESS")
    _probe(target)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except Exception as exc:  # Ray raises ConnectionError, AuthenticationError, RuntimeError...
        raise RayConnectError(_connect_problem(target, exc)) from exc


_FIND_THE_ADDRESS = (
    "Use the address `ray start --head` printed (\"ray start --address='IP:PORT'\": the head "
    "advertises this machine's interface address, not 127.0.0.1, even with --node-ip-address "
    "127.0.0.1; both reach it from the head machine) and check it with "
    "`ray status --address IP:PORT`; or use --address auto on a node of the cluster. If the "
    'cluster uses token authentication (`ray start` says "Token authentication is enabled"), '
    "set RAY_AUTH_MODE=token as well."
)


def _probe(address: str | None) -> None:
    """Fail fast when nothing accepts connections at a ``host:port`` address."""
    import socket

    host, _, port = (address or "").rpartition(":")
    if not host or not port.isdigit() or "://" in host:
        return  # auto, local, ray://... : Ray resolves those itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as error:
        raise RayConnectError(
            f"could not join the Ray cluster at {address!r}: nothing accepts connections "
            f"there ({error}). {_FIND_THE_ADDRESS}"
        ) from error


def _connect_problem(address: str | None, exc: BaseException) -> str:
    """Why joining ``address`` failed, and what to do about it."""
    chain: list[BaseException] = []
    error: BaseException | None = exc
    while error is not None and len(chain) < 5:
        chain.append(error)
        error = error.__cause__ or error.__context__
    said = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    where = f"the Ray cluster at {address!r}" if address else "a Ray cluster"
    mode = os.environ.get("RAY_AUTH_MODE")
    if any(
        type(e).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(e) for e in chain
    ):
        return (
            f"could not join {where}: it uses token authentication and this process sent no valid "
            f"token (RAY_AUTH_MODE={mode or 'unset'}; Ray said: {said}). `ray start --head` turns "
            "token authentication on whenever a token exists (~/.ray/auth_token, which any "
            "earlier local Ray writes). Fix: set RAY_AUTH_MODE=token for envhub, with the "
            "cluster's token in ~/.ray/auth_token (copy it from the head node), "
            "RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN; or use --address auto on a node of the "
            "cluster; or start the cluster with RAY_AUTH_MODE=disabled (then anyone who reaches "
            "it can run code on it)."
        )
    return f"could not join {where} ({type(exc).__name__}: {said}). {_FIND_THE_ADDRESS}"


_actor_class: Any = None


def _first_cause(error: BaseException) -> str:
    """What went wrong in an actor, in one line: the exception its ``__init__`` raised (Ray
    wraps it with the remote traceback), else Ray's own error's last line."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException) and cause is not error:
        return describe_error(cause)
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def _remote_class() -> Any:
    global _actor_class
    if _actor_class is None:
        import ray

        _actor_class = ray.remote(RayEnvHost)
    return _actor_class


class RayWorker(WorkerBase):
    """One Ray actor (see the module docstring)."""

    kind = "ray"

    def __init__(
        self,
        name: str,
        env: Any,
        env_kwargs: dict[str, Any],
        on_dead: DeathCallback,
        *,
        start_timeout_s: float = 60.0,
        ray_options: dict[str, Any] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        super().__init__(name, on_dead)
        self._env, self._env_kwargs = env, env_kwargs
        self._max_message_bytes = max_message_bytes
        self._options = {**DEFAULT_RAY_OPTIONS, **(ray_options or {})}
        self._start_timeout_s = start_timeout_s
        self._actor: Any = None
        self._pending_ids: collections.deque[Any] = collections.deque()
        self.node_id = ""
        self.pid = 0

    async def start(self) -> None:
        import ray

        connect(os.environ.get("RAY_ADDRESS"))
        self._actor = (
            _remote_class()
            .options(name=None, **self._options)
            .remote(self._env, self._env_kwargs, self._max_message_bytes)
        )
        try:
            where = await asyncio.wait_for(
                asyncio.wrap_future(self._actor.where.remote().future()), self._start_timeout_s
            )
        except TimeoutError:
            ray.kill(self._actor, no_restart=True)
            raise WorkerStartError(
                f"ray worker {self.name} was not placed within {self._start_timeout_s:.0f} s; the "
                f"cluster may lack the resources it asks for ({self._options}); check "
                "`ray status` or lower num_workers"
            ) from None
        except Exception as exc:
            ray.kill(self._actor, no_restart=True)
            raise WorkerStartError(
                f"ray worker {self.name} could not build the env: {_first_cause(exc)}"
            ) from exc
        self.node_id, self.pid = where["node_id"], where["pid"]
        self.location = self.node_id
        self._alive = True

    def submit(self, op: int, episode: int, body: bytes) -> asyncio.Future[tuple[int, bytes]]:
        if not self._alive:
            return self._lost_future()
        try:  # before it is queued: a call Ray refuses must not wait for an answer
            ref = self._actor.handle.remote(op, episode, body)
        except Exception as exc:  # noqa: BLE001 - PendingCallsLimitExceeded (max_pending_calls)...
            return self._refused_future(
                f"ray worker {self.name} refused the call for episode {episode} "
                f"({type(exc).__name__}: {str(exc)[:300]}); nothing ran: call again later"
            )
        future = self._loop.create_future()
        if not self._pending:
            self._head_since = self._loop.time()
        entry = (0, episode, future)
        self._pending.append(entry)
        ref.future().add_done_callback(lambda done: self._deliver(entry, done))
        return future

    def _deliver(
        self, entry: tuple[int, int, asyncio.Future[tuple[int, bytes]]], done: Any
    ) -> None:
        """(In Ray's callback thread.) Hand a finished call to the event loop; once that loop is
        closed (the pool was closed, a killed actor's call ended later) nobody waits for it."""
        with contextlib.suppress(RuntimeError):  # the event loop is closed
            self._loop.call_soon_threadsafe(self._finish, entry, done)

    def _finish(self, entry: tuple[int, int, asyncio.Future[tuple[int, bytes]]], done: Any) -> None:
        future = entry[2]
        if future.done():  # already resolved as lost
            return
        try:
            result = done.result()
        except Exception as exc:  # noqa: BLE001 - any error from the actor call: the worker is lost
            self._die(
                "worker_crashed",
                (
                    f"ray worker {self.name} on node {self.node_id[:12]} (pid {self.pid}) died: "
                    f"{type(exc).__name__}: {str(exc)[:300]}"
                ),
            )
            return
        if self._pending and self._pending[0] is entry:
            self._pending.popleft()
        else:
            try:
                self._pending.remove(entry)
            except ValueError:
                pass
        self._head_since = self._loop.time()
        future.set_result(result)

    def probe(self) -> None:
        """Ping the idle actor: one that died with nothing in flight fails the ping, and the pool
        replaces it before a reset lands on it."""
        if self._alive and not self._pending and self._options.get("max_pending_calls", -1) == -1:
            self.submit(OP_PING, -1, b"")

    def kill(self, reason: str, detail: str) -> None:
        if self._actor is not None:
            import ray

            with contextlib.suppress(Exception):  # the actor may be gone already
                ray.kill(self._actor, no_restart=True)
        self._die(reason, detail)

    async def stop(self) -> None:
        if self._alive and self._actor is not None:
            with contextlib.suppress(Exception):  # a clean close if it can; kill() follows anyway
                await asyncio.wait_for(asyncio.wrap_future(self._actor.close.remote().future()), 5)
        self.kill("pool_closed", "the pool was closed")
