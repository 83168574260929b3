"""Hub throughput: steps/s and step latency over WebSocket sessions, beside the stack and OpenEnv.

Why: trainers step thousands of episodes through the hub at once; the hub must add little
on top of the web stack it runs on. In one run (this machine's CPU share varies, so only
ratios within a run mean anything), closed loop (each session steps as soon as its answer
arrives), at 1, 64, 256 and 1,000 concurrent sessions:

* ``hub noop``    - ``envhub serve`` (2 worker processes) serving a no-op env;
* ``hub sokoban`` - the same serving ``games/sokoban-v0`` (sessions reset when an episode ends);
* ``bare``        - a bare FastAPI + uvicorn (uvloop) WebSocket server answering no-op steps
                    in-process: the stack's limit on this machine;
* ``openenv``     - OpenEnv (``openenv-core`` from PyPI, installed into its own temp venv)
                    serving an equivalent echo env, ``max_concurrent_envs`` raised to fit;
* ``gymnasium AsyncVectorEnv`` (8 no-op envs, local, no network) for scale.

Every server runs in its own process (the servers are in throughput_servers.py); the same load
generator (``--clients`` processes, asyncio + uvloop + the ``websockets`` client) drives all of
them. Server CPU is the server process plus its children (workers), in cores; RSS is their sum
at the end. Each point gets a fresh server process.

    python benchmarks/hub_throughput.py [--seconds 4] [--sessions 1,64,256,1000] [--clients 2]
        [--skip-openenv]

Last line: ``hub_vs_openenv_1000: X x`` (hub no-op steps/s over OpenEnv's at 1,000 sessions).
Before it: ``hub_vs_bare_1000`` and ``hub_cpu_per_step_vs_bare_1000`` (goals: >= 0.8 x and
<= 1.3 x) and ``hub_p99_ms_64`` (goal: < 10 ms).

The scale check, ``--sessions 10000 --servers hub`` (more ``--clients`` help): every session
must get steps answered in the window, p99 < 1 s, the server's RSS (workers included) < 2 GiB,
and once the clients close their sessions the hub must hold no session, no episode and no file
descriptor more than before (column ``left``); it prints PASS or FAIL and ends with
``hub_sessions_10000_p99: X ms``.
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import orjson
from throughput_servers import (
    OPENENV_SERVER,
    OPENENV_VENV,
    TOKEN,
    NoopEnv,
    Server,
    cpu_seconds,
    hub_state,
    open_fds,
    openenv_python,
    rss_mib,
    serve_bare,
    serve_hub,
    start_server,
)
from websockets.exceptions import WebSocketException

CLIENTS = 2
"""Load-generator processes (set by --clients): one Python client cannot saturate a server."""

SERVER_FAILURES = (
    RuntimeError,  # a refused session or step, a server that exited
    OSError,  # connection refused or reset, timeouts
    ValueError,  # an answer that is not JSON
    WebSocketException,  # a failed handshake, a closed connection
    queue.Empty,  # a load-generator process gave no result
    threading.BrokenBarrierError,  # a load-generator process failed before the window
)
"""What a failing server makes ``load`` raise; ``measure`` records it and goes on."""


# ---------------------------------------------------------------------- load generator
class Protocol:
    """How one kind of server is spoken to: URL, headers, session start, a step frame."""

    path = "/ws"
    headers: ClassVar[dict[str, str]] = {}

    async def start(self, ws: Any) -> None:
        pass

    def step(self, seq: int) -> str:
        return f'{{"type":"step","seq":{seq},"action":"x"}}'

    def done(self, reply: dict[str, Any]) -> bool:
        return False

    async def reset(self, ws: Any, seq: int) -> None:
        pass


class HubProtocol(Protocol):
    path = "/v1/session"
    headers: ClassVar[dict[str, str]] = {"Authorization": f"Bearer {TOKEN}"}

    def __init__(self, env: str, action: str) -> None:
        self.env, self.action = env, action

    async def start(self, ws: Any) -> None:
        await ws.send(orjson.dumps({"type": "hello", "env": self.env}).decode())
        welcome = orjson.loads(await ws.recv())
        if welcome["type"] != "welcome":
            raise RuntimeError(f"hub refused a session: {welcome}")
        await self.reset(ws, 1)

    async def reset(self, ws: Any, seq: int) -> None:
        await ws.send(f'{{"type":"reset","seq":{seq},"seed":{seq}}}')
        reply = orjson.loads(await ws.recv())
        if reply["type"] != "reset_result":
            raise RuntimeError(f"reset failed: {reply}")

    def step(self, seq: int) -> str:
        return f'{{"type":"step","seq":{seq},"action":"{self.action}"}}'

    def done(self, reply: dict[str, Any]) -> bool:
        result = reply.get("result")
        if result is None:
            raise RuntimeError(f"step failed: {reply}")
        return result["terminated"] or result["truncated"]


async def drive(
    port: int, protocol: Protocol, sessions: int, warmup: float, seconds: float, barrier: Any
) -> tuple[int, list[float], int]:
    """One load-generator process: ``sessions`` connections, closed loop; the steps and their
    latencies in the measuring window, and how many sessions got at least one step answered
    in it (served)."""
    from websockets.asyncio.client import connect

    url = f"ws://127.0.0.1:{port}{protocol.path}"
    ready = asyncio.Event()
    measuring = {"on": False}
    latencies: list[float] = []
    counts = [0]
    gate = asyncio.Semaphore(4)  # OpenEnv's server wedges under many concurrent handshakes
    connected = [0]
    served = [0]
    stop = asyncio.Event()

    async def session() -> None:
        async with gate:
            ws = await connect(
                url,
                additional_headers=protocol.headers,
                compression=None,
                max_size=None,
                ping_interval=None,
                open_timeout=300,
            )
            await protocol.start(ws)
        connected[0] += 1
        if connected[0] == sessions:
            ready.set()
        await ready.wait()
        seq, mine = 2, 0
        perf = time.perf_counter
        try:
            while not stop.is_set():
                began = perf()
                await ws.send(protocol.step(seq))
                reply = orjson.loads(await ws.recv())
                if measuring["on"]:
                    latencies.append(perf() - began)
                    counts[0] += 1
                    mine += 1
                seq += 1
                if protocol.done(reply):
                    await protocol.reset(ws, seq)
                    seq += 1
        finally:
            served[0] += mine > 0
            await ws.close()

    tasks = [asyncio.create_task(session()) for _ in range(sessions)]
    waiter = asyncio.create_task(ready.wait())
    done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED, timeout=600)
    if waiter not in done:
        for task in done:
            task.result()  # raise the session's error
        raise RuntimeError("sessions did not connect in time")
    # until every load-generator process has connected its sessions
    await asyncio.get_running_loop().run_in_executor(None, barrier.wait, 600)
    await asyncio.sleep(warmup)
    measuring["on"] = True
    await asyncio.sleep(seconds)
    measuring["on"] = False
    steps = counts[0]
    stop.set()
    await asyncio.wait(tasks, timeout=60)
    return steps, latencies, served[0]


def _client(
    port: int,
    protocol: Protocol,
    sessions: int,
    warmup: float,
    seconds: float,
    barrier: Any,
    results: Any,
) -> None:
    import uvloop

    try:
        results.put(uvloop.run(drive(port, protocol, sessions, warmup, seconds, barrier)))
    except BaseException as exc:
        barrier.abort()
        results.put(exc)
        raise


def load(
    port: int, protocol: Protocol, sessions: int, seconds: float, pids: list[int], clients: int
) -> dict[str, float]:
    """Run ``sessions`` closed-loop sessions from ``clients`` processes; measure one window."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    clients = max(1, min(clients, sessions))
    barrier, results = context.Barrier(clients + 1), context.Queue()
    warmup = min(1.0, seconds / 4)
    shares = [sessions // clients + (1 if i < sessions % clients else 0) for i in range(clients)]
    procs = [
        context.Process(target=_client, args=(port, protocol, n, warmup, seconds, barrier, results))
        for n in shares
    ]
    for proc in procs:
        proc.start()
    barrier.wait(600)
    time.sleep(warmup)
    cpu0, t0 = cpu_seconds(pids), time.perf_counter()
    time.sleep(seconds)
    elapsed, cpu = time.perf_counter() - t0, cpu_seconds(pids) - cpu0
    rss = rss_mib(pids)
    steps, latencies, served = 0, [], 0
    for _ in procs:
        got = results.get(timeout=120)
        if isinstance(got, BaseException):
            raise got
        steps += got[0]
        latencies += got[1]
        served += got[2]
    for proc in procs:
        proc.join(30)
    latencies.sort()
    pick = lambda q: (
        latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000
        if latencies
        else float("nan")
    )
    return {
        "steps_per_s": steps / elapsed,
        "p50_ms": pick(0.5),
        "p99_ms": pick(0.99),
        "cpu_cores": cpu / elapsed,
        "rss_mib": rss,
        "served": served,
    }


class OpenEnvProtocol(Protocol):
    async def start(self, ws: Any) -> None:
        await self.reset(ws, 0)

    async def reset(self, ws: Any, seq: int) -> None:
        await ws.send('{"type":"reset","data":{}}')
        reply = orjson.loads(await ws.recv())
        if reply.get("type") != "observation":
            raise RuntimeError(f"OpenEnv reset failed: {reply}")

    def step(self, seq: int) -> str:
        return '{"type":"step","data":{"message":"x"}}'

    def done(self, reply: dict[str, Any]) -> bool:
        if reply.get("type") != "observation":
            raise RuntimeError(f"OpenEnv step failed: {reply}")
        return False


# ---------------------------------------------------------------------- Gymnasium, locally
def gymnasium_async_vector_rate(seconds: float, num_envs: int = 8) -> float:
    """Env-steps/s of ``gymnasium.vector.AsyncVectorEnv`` over ``num_envs`` no-op text envs."""
    import gymnasium

    vector = gymnasium.vector.AsyncVectorEnv(
        [NoopEnv for _ in range(num_envs)], shared_memory=False
    )
    try:
        vector.reset(seed=0)
        actions = tuple("x" for _ in range(num_envs))
        for _ in range(50):
            vector.step(actions)
        steps, began = 0, time.perf_counter()
        while time.perf_counter() - began < seconds:
            vector.step(actions)
            steps += num_envs
        return steps / (time.perf_counter() - began)
    finally:
        vector.close()


# ---------------------------------------------------------------------- main
def measure(
    name: str,
    start: Callable[[], Server],
    protocol: Protocol,
    sessions: list[int],
    seconds: float,
    rows: list[dict[str, Any]],
    hub: bool = False,
) -> None:
    """Measure one server at each session count, on a fresh server process per count; for a hub,
    also what its sessions left behind once their clients closed them (``leftover``).

    A fresh process per point keeps RSS comparable and sidesteps OpenEnv's server refusing
    new sessions after the previous point's sessions disconnect (seen with openenv-core 0.3.0).
    """
    nan = float("nan")
    for count in sessions:
        server = start()
        fds = open_fds(server.proc.pid)
        try:
            result = load(server.port, protocol, count, seconds, server.pids, CLIENTS)
            result["leftover"] = leftover(server, fds) if hub else nan
        except SERVER_FAILURES as exc:  # one failing server must not lose the run: record it
            print(f"{name:14} {count:>6} failed: {type(exc).__name__}: {exc}"[:300], flush=True)
            result = {
                "steps_per_s": nan,
                "p50_ms": nan,
                "p99_ms": nan,
                "cpu_cores": nan,
                "rss_mib": nan,
                "served": 0,
                "leftover": nan,
            }
        finally:
            server.stop()
        row = {"server": name, "sessions": count, **result}
        rows.append(row)
        print(
            f"{name:14} {count:>6} {row['steps_per_s']:>10,.0f} {row['p50_ms']:>8.2f} "
            f"{row['p99_ms']:>8.2f} {row['cpu_cores']:>6.2f} {row['rss_mib']:>8.0f} "
            f"{row['served']:>7} {row['leftover']:>5}",
            flush=True,
        )


def leftover(server: Server, fds_before: int, wait_s: float = 60.0) -> int:
    """What the hub still holds once every client has closed its session: open sessions, live
    episodes, and file descriptors over what it held before the load (0: nothing leaked).
    Closing thousands of sockets takes a moment, so this waits up to ``wait_s`` for zero."""
    deadline = time.monotonic() + wait_s
    while True:
        sessions, episodes = hub_state(server.port)
        extra_fds = max(0, open_fds(server.proc.pid) - fds_before)
        left = sessions + episodes + extra_fds
        if left == 0 or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="measuring time per point")
    parser.add_argument(
        "--sessions", default="1,64,256,1000", help="concurrent sessions, comma-separated"
    )
    parser.add_argument("--clients", type=int, default=2, help="load-generator processes")
    parser.add_argument("--skip-openenv", action="store_true", help="do not install or run OpenEnv")
    parser.add_argument(
        "--servers", default="bare,hub,inline,sokoban,openenv", help="which servers to measure"
    )
    parser.add_argument(
        "--openenv-venv",
        type=Path,
        default=OPENENV_VENV,
        help="venv for openenv-core (created if missing)",
    )
    parser.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)  # internal: run one server
    args = parser.parse_args()
    if args.serve:
        kind, port = args.serve[0], int(args.serve[1])
        if kind == "hub":
            serve_hub(port, args.serve[2], args.serve[3])
        elif kind == "bare":
            serve_bare(port)
        return
    global CLIENTS
    CLIENTS = args.clients
    sessions = [int(s) for s in args.sessions.split(",")]
    me = [sys.executable, str(Path(__file__).resolve()), "--serve"]
    rows: list[dict[str, Any]] = []
    print(
        f"{'server':14} {'sess':>6} {'steps/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'cpu':>6} "
        f"{'rss MiB':>8} {'served':>7} {'left':>5}",
        flush=True,
    )
    chosen = set(args.servers.split(","))
    runs = [
        ("bare", "bare", ["bare"], Protocol()),
        ("hub", "hub noop", ["hub", "bench/noop-v0", "local"], HubProtocol("bench/noop-v0", "x")),
        (
            "inline",
            "hub noop inl",
            ["hub", "bench/noop-v0", "inline"],
            HubProtocol("bench/noop-v0", "x"),
        ),
        (
            "sokoban",
            "hub sokoban",
            ["hub", "games/sokoban-v0", "local"],
            HubProtocol("games/sokoban-v0", "<answer>left</answer>"),
        ),
    ]
    for key, name, serve, protocol in runs:
        if key in chosen:
            measure(
                name,
                lambda serve=serve: start_server([*me, serve[0], "{port}", *serve[1:]]),
                protocol,
                sessions,
                args.seconds,
                rows,
                hub=serve[0] == "hub",
            )
    if "openenv" in chosen and not args.skip_openenv:
        from_openenv(sessions, args.seconds, rows, args.openenv_venv)
    gym_rate = gymnasium_async_vector_rate(args.seconds)
    print(f"gymnasium AsyncVectorEnv (8 no-op envs, local): {gym_rate:,.0f} env-steps/s")
    by = {(r["server"], r["sessions"]): r for r in rows}
    top = max(sessions)
    hub = by.get(("hub noop", top))
    if hub is None:
        return
    for name in ("bare", "hub noop inl"):
        other = by.get((name, top))
        if other is not None:
            ratio = hub["steps_per_s"] / other["steps_per_s"]
            print(f"hub_vs_{name.replace(' ', '_')}_{top}: {ratio:.2f} x")
    cpu_us = {
        name: 1e6 * r["cpu_cores"] / r["steps_per_s"]
        for (name, count), r in by.items()
        if count == top and r["steps_per_s"] > 0
    }
    print(
        f"server CPU per step at {top} sessions (us, workers included): "
        + ", ".join(f"{k} {v:.0f}" for k, v in cpu_us.items())
    )
    if "bare" in cpu_us and "hub noop" in cpu_us:
        print(f"hub_cpu_per_step_vs_bare_{top}: {cpu_us['hub noop'] / cpu_us['bare']:.2f} x")
    if ("hub noop", 64) in by:
        print(f"hub_p99_ms_64: {by[('hub noop', 64)]['p99_ms']:.2f} ms")
    if top >= 10_000:  # the scale check: every session served, p99, memory, nothing left behind
        checks = {
            "served": (hub["served"] == top, f"{hub['served']}/{top} sessions stepped"),
            "p99": (hub["p99_ms"] < 1000, f"p99 {hub['p99_ms']:.0f} ms (< 1000)"),
            "rss": (hub["rss_mib"] < 2048, f"RSS {hub['rss_mib']:.0f} MiB (< 2048)"),
            "leaks": (hub["leftover"] == 0, f"{hub['leftover']} sessions/episodes/fds left"),
        }
        verdict = "PASS" if all(ok for ok, _ in checks.values()) else "FAIL"
        print(f"hub at {top} sessions: {verdict}: " + "; ".join(why for _, why in checks.values()))
        print(f"hub_sessions_{top}_p99: {hub['p99_ms']:.0f} ms")
        return
    if ("openenv", top) in by:
        ratio = hub["steps_per_s"] / by[("openenv", top)]["steps_per_s"]
        print(f"hub_vs_openenv_{top}: {ratio:.2f} x")


def from_openenv(
    sessions: list[int], seconds: float, rows: list[dict[str, Any]], venv: Path
) -> None:
    python = openenv_python(venv)
    script = venv / "envhub_bench_echo_server.py"
    script.write_text(OPENENV_SERVER)
    measure(
        "openenv",
        lambda: start_server(
            [str(python), str(script), "{port}"], env={"ENABLE_WEB_INTERFACE": "false"}
        ),
        OpenEnvProtocol(),
        sessions,
        seconds,
        rows,
    )


if __name__ == "__main__":
    main()
