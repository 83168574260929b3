"""Admission control: N clients open sessions on one hub at the same moment.

Why: a trainer starts all its env sessions at once, and a hub has a session limit. Every
client must get an answer - a session, or ``too_many_sessions`` (an error message and close
code 1013, "try again later") - never a connection cut off unread, and the hub must survive and
end with nothing held. ``envhub serve``'s configuration (2 worker processes, its default
``--max-sessions`` 4096) serves the no-op env; ``--clients`` processes each open their share of
the connections concurrently, each client saying hello, resetting once and closing.

    python benchmarks/hub_burst.py [--connections 10000] [--clients 4]

Prints the outcomes by kind, the hub's own rejection counters, and what it held afterwards;
last line: ``hub_burst_cut_off: N connections`` (goal: 0).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing
import sys
import time
import urllib.request
from typing import Any

import orjson
from throughput_servers import TOKEN, hub_state, open_fds, start_server

SESSION_LIMIT = 4096
"""The hub's ``--max-sessions`` (``envhub serve``'s default)."""


def _one_client(port: int, count: int, results: Any) -> None:
    """``count`` concurrent connections: hello, one reset, close; the outcome of each."""
    import uvloop
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake

    async def session() -> str:
        try:
            ws = await connect(
                f"ws://127.0.0.1:{port}/v1/session",
                additional_headers={"Authorization": f"Bearer {TOKEN}"},
                open_timeout=120,
                ping_interval=None,
                compression=None,
            )
        except (OSError, TimeoutError, InvalidHandshake, ConnectionClosed) as exc:
            return f"cut off ({type(exc).__name__})"
        try:
            await ws.send(orjson.dumps({"type": "hello", "env": "bench/noop-v0"}).decode())
            reply = orjson.loads(await asyncio.wait_for(ws.recv(), 120))
            if reply["type"] != "welcome":
                return f"refused: {reply.get('code')}"
            await ws.send('{"type":"reset","seq":1,"seed":1}')
            reset = orjson.loads(await asyncio.wait_for(ws.recv(), 120))
            return "served" if reset["type"] == "reset_result" else f"reset: {reset.get('code')}"
        except ConnectionClosed as exc:  # refused before hello was read: the close code says why
            code = exc.rcvd.code if exc.rcvd is not None else None
            return f"refused: close {code}" if code == 1013 else f"cut off (close {code})"
        except (OSError, TimeoutError) as exc:
            return f"cut off ({type(exc).__name__})"
        finally:
            await ws.close()

    async def main() -> collections.Counter[str]:
        return collections.Counter(await asyncio.gather(*(session() for _ in range(count))))

    results.put(uvloop.run(main()))


def _serve(port: str) -> None:
    import throughput_servers

    throughput_servers.HUB_MAX_SESSIONS = SESSION_LIMIT
    throughput_servers.serve_hub(int(port), "bench/noop-v0", "local")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=4, help="load-generator processes")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # internal: run the hub on this port
    args = parser.parse_args()
    if args.serve:
        _serve(args.serve)
        return
    server = start_server([sys.executable, __file__, "--serve", "{port}"])
    try:
        fds = open_fds(server.proc.pid)
        context = multiprocessing.get_context("fork")
        results = context.Queue()
        shares = [args.connections // args.clients] * args.clients
        shares[0] += args.connections - sum(shares)
        began = time.perf_counter()
        procs = [
            context.Process(target=_one_client, args=(server.port, n, results)) for n in shares
        ]
        for proc in procs:
            proc.start()
        outcomes: collections.Counter[str] = collections.Counter()
        for _ in procs:
            outcomes += results.get(timeout=600)
        for proc in procs:
            proc.join(30)
        elapsed = time.perf_counter() - began
        alive = server.proc.poll() is None
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.port}/metrics",
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            metrics = answer.read().decode()
        rejected = [
            line
            for line in metrics.splitlines()
            if line.startswith("envhub_rejected_connections_total")
        ]
        deadline = time.monotonic() + 60
        while True:  # closing thousands of sockets takes a moment
            sessions, episodes = hub_state(server.port)
            extra = max(0, open_fds(server.proc.pid) - fds)
            if sessions + episodes + extra == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        server.stop()
    print(f"{args.connections} connections at once, hub --max-sessions {SESSION_LIMIT}:")
    for outcome, count in outcomes.most_common():
        print(f"  {count:>6}  {outcome}")
    print(f"in {elapsed:.1f} s; hub alive: {alive}; its counters: {'; '.join(rejected)}")
    print(f"afterwards the hub held {sessions} sessions, {episodes} episodes, {extra} extra fds")
    cut = sum(count for outcome, count in outcomes.items() if outcome.startswith("cut off"))
    print(f"hub_burst_cut_off: {cut} connections")


if __name__ == "__main__":
    main()
