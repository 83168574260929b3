"""Start+exec latency and exec throughput of every sandbox path, side by side in one run.

Why: code environments run a sandboxed command on every step; what a sandbox costs per call
decides whether the hot path is the model or the sandbox. Paths measured, all running the
same command (``true`` by default: pure sandbox overhead):

- ``subprocess``   plain ``subprocess.run`` on the host, no isolation (the floor);
- ``local-cold``   ``LocalSandbox``: start + run + stop per call (namespaces, uid, cgroups,
                   tmpfs);
- ``local-warm``   ``SandboxPool("local")``: acquire + run + release (reset happens in the
                   background): a new user per call;
- ``local-exec``   a warm sandbox already held: run only (the fork server forks, the child
                   execs the command): what each further call of the same user costs;
- ``local-python`` the same with ``python3 -I -c pass``, which the fork server runs in its own
                   forked interpreter (``run_code``, the code envs' test runner);
- ``local-python-exec`` ``python3 -c pass`` in a warm sandbox: a new interpreter per run, the
                   path ``local-python`` replaces;
- ``local-reset``  one warm sandbox: run + ``reset()`` in place (sweep, clean, verify what is
                   spared): what a pooled sandbox costs per user, paid in the pool's background
                   thread;
- ``local-restart`` one warm sandbox: run + reset with a fresh executor in fresh namespaces (the
                   "restart between users" alternative to verifying in place);
- ``docker-warm``  ``SandboxPool("docker")``: acquire + ``docker exec`` + release;
- ``docker-run``   the ``docker run --rm --network none ...`` CLI per call (a cold container).

For each: p50/p99 latency of one call at concurrency 1, and calls/s at concurrency 1, 2, 8
(threads). Docker paths use ``--docker-host`` or a private dockerd this script starts (root),
after the local paths are measured and their pools closed (an engine starting containers
beside them took cores from them: local-cold 12.6-13.6 ms alone, 16.9-17.6 ms measured after).

    python benchmarks/sandbox_latency.py [--ops 40] [--command true] [--docker-host unix:///...]
        [--paths local-warm,local-reset] [--no-seccomp] [--no-docker] [--caller-mib 0]

Last line: ``local_warm_p50: X ms``.
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from sandboxes import Limits, SandboxPool, SandboxUnavailableError
from sandboxes.local import LocalSandbox

LIMITS = Limits(wall_time_s=30, memory_mb=256, max_processes=64)


def measure(op: Callable[[], None], *, concurrency: int, ops: int) -> tuple[list[float], float]:
    """Run ``ops`` calls spread over ``concurrency`` threads: (per-call latencies in s, calls/s)."""
    latencies: list[float] = []
    lock = threading.Lock()
    per_thread = max(1, ops // concurrency)

    def worker() -> None:
        for _ in range(per_thread):
            t0 = time.perf_counter()
            op()
            dt = time.perf_counter() - t0
            with lock:
                latencies.append(dt)

    op()  # warm-up (page cache, first-call imports)
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, len(latencies) / (time.perf_counter() - start)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure_paths(
    paths: dict[str, Callable[[], None]], only: set[str] | None, ops: int
) -> list[tuple[str, float, float, dict[int, float]]]:
    """p50/p99 (ms) at concurrency 1 and calls/s at 1, 2 and 8 for each path in ``only``."""
    rows = []
    for name, op in paths.items():
        if only is not None and name not in only:
            continue
        n = max(8, ops // 4) if name == "docker-run" else ops
        lat, rate1 = measure(op, concurrency=1, ops=n)
        rates = {1: rate1}
        for conc in (2, 8):
            rates[conc] = measure(op, concurrency=conc, ops=n)[1]
        rows.append((name, pct(lat, 0.5) * 1e3, pct(lat, 0.99) * 1e3, rates))
        print(
            f"{name:13} p50 {rows[-1][1]:8.1f} ms  p99 {rows[-1][2]:8.1f} ms  "
            + "  ".join(f"c{c}: {r:7.1f}/s" for c, r in rates.items()),
            flush=True,
        )
    return rows


def measure_docker(
    argv: list[str], docker_host: str | None, only: set[str] | None, ops: int
) -> list[tuple[str, float, float, dict[int, float]]]:
    """The docker paths, on ``docker_host`` or a private dockerd started here (root)."""
    paths: dict[str, Callable[[], None]] = {}
    with contextlib.ExitStack() as stack:
        try:
            url = docker_host
            if url is None:
                from sandboxes.dockerd import private_dockerd

                url = stack.enter_context(private_dockerd())
            from sandboxes.dockerd import HOST_USR_RO, import_host_image

            image = import_host_image(url)
            docker_pool = stack.enter_context(
                SandboxPool(
                    "docker", size=8, limits=LIMITS, image=image, base_url=url, volumes=HOST_USR_RO
                )
            )
        except (SandboxUnavailableError, ImportError) as e:
            print(f"docker paths skipped: {e}")
            return []

        def docker_warm() -> None:
            with docker_pool.acquire() as sb:
                sb.run(argv)

        cli = shutil.which("docker") or "docker"
        run_cmd = [
            cli,
            "-H",
            url,
            "run",
            "--rm",
            "--network",
            "none",
            "--memory",
            "256m",
            "--pids-limit",
            "67",
            "--read-only",
            "-u",
            "1000:1000",
            "-v",
            "/usr:/usr:ro",
            image,
            *argv,
        ]

        def docker_run() -> None:
            subprocess.run(run_cmd, check=True, stdout=subprocess.DEVNULL)

        paths["docker-warm"], paths["docker-run"] = docker_warm, docker_run
        return measure_paths(paths, only, ops)


def main() -> None:
    # clean up pools and dockerd when killed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--ops",
        type=int,
        default=40,
        help="calls per (path, concurrency); docker-run uses a quarter",
    )
    parser.add_argument(
        "--command", default="true", help="the command every path runs (argv, split on spaces)"
    )
    parser.add_argument(
        "--docker-host", default=None, help="engine URL; default: start a private dockerd (root)"
    )
    parser.add_argument("--no-docker", action="store_true", help="skip the docker paths")
    parser.add_argument(
        "--no-seccomp",
        action="store_true",
        help="run the local paths without the seccomp filter (to measure what it costs)",
    )
    parser.add_argument(
        "--paths", default="", help="comma-separated subset of paths to measure (default: all)"
    )
    parser.add_argument(
        "--caller-mib",
        type=int,
        default=0,
        help="first touch this many MiB in this process: sandboxes are started from trainer and "
        "hub processes of GiBs, and a launch that forks its caller pays for its page tables",
    )
    args = parser.parse_args()
    argv = args.command.split()
    ballast = bytearray(args.caller_mib << 20)
    for page in range(0, len(ballast), 4096):
        ballast[page] = 1
    if args.no_seccomp:
        from sandboxes import _seccomp

        _seccomp._compiled.cache_clear()
        _seccomp._compiled = lambda: (None, "disabled by --no-seccomp")  # type: ignore[assignment]

    paths: dict[str, Callable[[], None]] = {}
    cleanups: list[Callable[[], None]] = []
    paths["subprocess"] = lambda: subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)

    def local_cold() -> None:
        with LocalSandbox(limits=LIMITS) as sb:
            sb.run(argv)

    local_pool = SandboxPool("local", size=8, limits=LIMITS)
    cleanups.append(local_pool.close)

    def local_warm() -> None:
        with local_pool.acquire() as sb:
            sb.run(argv)

    paths["local-cold"], paths["local-warm"] = local_cold, local_warm
    spare: queue.Queue[LocalSandbox] = queue.Queue()
    for _ in range(8):
        spare.put(LocalSandbox(limits=LIMITS, warm_exec=True).start())
    cleanups.append(lambda: [spare.get().stop() for _ in range(spare.qsize())])

    def held(command: list[str]) -> Callable[[], None]:
        def op() -> None:
            sb = spare.get()
            try:
                sb.run(command)
            finally:
                spare.put(sb)

        return op

    paths["local-exec"] = held(argv)
    paths["local-python"] = held(["python3", "-I", "-c", "pass"])
    paths["local-python-exec"] = held(["python3", "-c", "pass"])

    def local_reset(restart: bool) -> None:
        sb = spare.get()
        try:
            sb.run(argv)
            if restart and sb._executor is not None:
                sb._executor.stop()
            sb.reset()
        finally:
            spare.put(sb)

    paths["local-reset"] = lambda: local_reset(False)
    paths["local-restart"] = lambda: local_reset(True)
    isolation = LocalSandbox(limits=LIMITS).start()
    print(f"local isolation: {isolation.isolation}; protections: {isolation.protections}")
    isolation.stop()

    only = (set(args.paths.split(",")) | {"subprocess", "local-warm"}) if args.paths else None
    rows = measure_paths(paths, only, args.ops)
    for cleanup in cleanups:  # the local pools go before a Docker engine starts: its start-up
        cleanup()  # and its containers' would share this machine's cores with them
    if not args.no_docker and (only is None or only & {"docker-warm", "docker-run"}):
        rows += measure_docker(argv, args.docker_host, only, args.ops)

    base = next(r for r in rows if r[0] == "subprocess")
    print("\n| path | p50 ms | p99 ms | calls/s c1 | c2 | c8 | p50 vs subprocess |")
    print("|---|---|---|---|---|---|---|")
    for name, p50, p99, rates in rows:
        print(
            f"| {name} | {p50:.1f} | {p99:.1f} | {rates[1]:.0f} | {rates[2]:.0f} | {rates[8]:.0f} "
            f"| {p50 / base[1]:.1f} x |"
        )
    measured = {name: (p50, rates) for name, p50, _, rates in rows}
    if "local-cold" in measured:
        print(f"\nlocal_cold_p50: {measured['local-cold'][0]:.1f} ms")
    for name in ("local-exec", "local-python"):
        if name in measured:
            p50, rates = measured[name]
            print(f"{name.replace('-', '_')}_p50: {p50:.1f} ms ({rates[2]:.0f}/s at concurrency 2)")
    warm = measured["local-warm"]
    print(f"local_warm_c2: {warm[1][2]:.0f} calls/s")
    print(f"local_warm_p50: {warm[0]:.1f} ms")


if __name__ == "__main__":
    main()
