"""Adapter overhead: adapted envs through envhub vs their own API; OpenEnv's client against
`envhub serve --protocol openenv` vs against OpenEnv's own server.

Why: an adapter must not make another ecosystem's envs slower to train on (goal: >= 0.9 x the
source's own steps/s), and envhub's server should serve OpenEnv's clients faster than OpenEnv's
server does (goal: >= 2 x). In one run (this machine's CPU share varies; only ratios within a
run mean anything):

* **in process**, one env at a time, the same actions, rounds alternated (own, envhub, own,
  envhub, ...) and the best round of each kept:
  - ``reasoning-gym`` ``basic_arithmetic``: ``dataset[i]`` + ``score_answer`` vs
    ``reasoning-gym/basic_arithmetic-v0`` reset + step (one step per episode);
  - ``textarena`` ``GuessTheNumber-v0`` (the unwrapped game): ``reset``/``step``/
    ``get_observation`` vs ``textarena/GuessTheNumber-v0``;
  - ``gem`` ``game:Mastermind-v0-easy``: ``reset``/``step`` vs ``gem/game.Mastermind-easy-v0``;
* **over the network**, closed loop, ``--sessions`` concurrent sessions of OpenEnv's own
  async client (``GenericEnvClient``) in ``--clients`` processes, the same envhub env
  (``games/guess-number-v0``) on both servers: ``envhub serve --protocol openenv --workers 2``,
  and OpenEnv's ``create_app`` serving that env wrapped as an OpenEnv ``Environment``
  (``max_concurrent_envs`` raised to fit; uvicorn as OpenEnv's template runs it).

    python benchmarks/adapter_overhead.py [--seconds 3] [--rounds 3] [--sessions 1,64]

Last line: ``openenv_client_hub_vs_openenv: X x`` (steps/s through envhub serve over OpenEnv's
server, at the largest --sessions).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENV_ID = "games/guess-number-v0"
ACTIONS = ["<answer>50</answer>", "<answer>25</answer>", "<answer>75</answer>", "[10]", "hmm"]


# ---------------------------------------------------------------------- in process
def rate(play: Callable[[int], int], seconds: float) -> float:
    """Steps/s of ``play(episode) -> steps`` over ``seconds``."""
    steps, episode, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        steps += play(episode)
        episode += 1
    return steps / (time.perf_counter() - start)


def gym_episode(env: Any, moves: list[str], episode: int) -> int:
    """One episode of a Gymnasium-API env (GEM's own or an envhub id) on fixed moves: steps
    played."""
    env.reset(seed=episode)
    for steps, move in enumerate(moves, 1):
        _, _, terminated, truncated, _ = env.step(move)
        if terminated or truncated:
            return steps
    return len(moves)


def reasoning_gym_pair() -> tuple[Callable[[int], int], Callable[[int], int]]:
    import reasoning_gym

    import envhub

    dataset = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=500)

    def own(episode: int) -> int:
        entry = dataset[episode % 500]
        dataset.score_answer(str(episode), entry)
        return 1

    env = envhub.make("reasoning-gym/basic_arithmetic-v0")

    def adapted(episode: int) -> int:
        env.reset(seed=episode)
        env.step(f"<answer>{episode}</answer>")
        return 1

    return own, adapted


def textarena_pair() -> tuple[Callable[[int], int], Callable[[int], int]]:
    import envhub
    from envhub.adapters.textarena import TextArenaEnv

    env = envhub.make("textarena/GuessTheNumber-v0")
    game = TextArenaEnv(game="GuessTheNumber-v0")._source  # the same unwrapped game class
    moves = [f"[{n}]" for n in (10, 5, 15, 3, 18, 7, 12, 1, 20, 9)]

    def own(episode: int) -> int:
        game.reset(num_players=1, seed=episode)
        game.get_observation()
        for steps, move in enumerate(moves, 1):
            done, _ = game.step(move)
            game.get_observation()
            if done:
                game.close()
                return steps
        return len(moves)

    return own, partial(gym_episode, env, moves)


def gem_pair() -> tuple[Callable[[int], int], Callable[[int], int]]:
    from gem.envs.registration import make as gem_make

    import envhub

    game = gem_make("game:Mastermind-v0-easy")
    env = envhub.make("gem/game.Mastermind-easy-v0")
    moves = [f"\\boxed{{{a} {b}}}" for a, b in ((1, 2), (3, 4), (5, 6), (2, 1), (4, 3))] * 2

    return partial(gym_episode, game, moves), partial(gym_episode, env, moves)


def in_process(seconds: float, rounds: int) -> dict[str, tuple[float, float]]:
    results = {}
    for name, pair in [
        ("reasoning-gym basic_arithmetic", reasoning_gym_pair),
        ("textarena GuessTheNumber-v0", textarena_pair),
        ("gem game:Mastermind-v0-easy", gem_pair),
    ]:
        own, adapted = pair()
        rate(own, 0.3), rate(adapted, 0.3)  # warm-up
        own_rates, adapted_rates = [], []
        for _ in range(rounds):
            own_rates.append(rate(own, seconds))
            adapted_rates.append(rate(adapted, seconds))
        results[name] = (max(own_rates), max(adapted_rates))
        added_us = 1e6 * (1 / max(adapted_rates) - 1 / max(own_rates))
        print(
            f"  {name:34} own {max(own_rates):9.0f}  envhub {max(adapted_rates):9.0f} steps/s  "
            f"{max(adapted_rates) / max(own_rates):.2f} x  (+{added_us:.1f} us per step)",
            flush=True,
        )
    return results


# ---------------------------------------------------------------------- servers
def openenv_app() -> Any:
    """OpenEnv's own server for ``ENV_ID``: the envhub env wrapped as an OpenEnv Environment."""
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field

    import envhub

    class TextAction(Action):
        message: str

    class TextObservation(Observation):
        messages: list[dict[str, Any]] = Field(default_factory=list)
        info: dict[str, Any] = Field(default_factory=dict)

    class EnvhubEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            self.env = envhub.make(ENV_ID)
            self._state = State()

        def reset(self, seed: int | None = None, episode_id: str | None = None) -> Any:
            messages, info = self.env.reset(seed=seed)
            self._state = State(episode_id=episode_id)
            return TextObservation(messages=messages, info=info)

        def step(self, action: TextAction) -> Any:  # type: ignore[override]
            messages, reward, terminated, truncated, info = self.env.step(action.message)
            self._state.step_count += 1
            return TextObservation(
                messages=messages, info=info, reward=reward, done=terminated or truncated
            )

        @property
        def state(self) -> State:
            return self._state

    return create_app(EnvhubEnvironment, TextAction, TextObservation, max_concurrent_envs=4096)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(kind: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])}
    if kind == "envhub":
        command = [sys.executable, "-m", "envhub.cli", "serve", "--env", ENV_ID, "--protocol"]
        command += ["openenv", "--no-auth", "--workers", "2", "--port", str(port)]
    else:
        command = [sys.executable, "-m", "uvicorn", "adapter_overhead:openenv_app", "--factory"]
        command += ["--port", str(port), "--log-level", "warning"]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # an external process: poll its health with a deadline
        if process.poll() is not None:
            raise RuntimeError(f"the {kind} server exited with {process.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
            return process, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the {kind} server did not answer /health within 180 s")


# ---------------------------------------------------------------------- load generator
async def _sessions(url: str, sessions: int, seconds: float) -> int:
    from openenv.core.generic_client import GenericEnvClient

    counts = [0] * sessions

    async def one(index: int) -> None:
        client = GenericEnvClient(base_url=url, message_timeout_s=120)
        await client.connect()
        deadline = time.perf_counter() + seconds
        episode = index * 100_000
        await client.reset(seed=episode)
        turn = 0
        while time.perf_counter() < deadline:
            result = await client.step({"message": ACTIONS[turn % len(ACTIONS)]})
            counts[index] += 1
            turn += 1
            if result.done:
                episode += 1
                await client.reset(seed=episode)
        await client.close()

    await asyncio.gather(*(one(i) for i in range(sessions)))
    return sum(counts)


def _client(url: str, sessions: int, seconds: float, out: Any) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    out.put(asyncio.run(_sessions(url, sessions, seconds)))


def load(url: str, sessions: int, clients: int, seconds: float) -> float:
    """Steps/s of ``sessions`` closed-loop sessions split over ``clients`` processes."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    shares = [sessions // clients + (i < sessions % clients) for i in range(clients)]
    workers = [
        context.Process(target=_client, args=(url, share, seconds, out))
        for share in shares
        if share
    ]
    for worker in workers:
        worker.start()
    total = sum(out.get(timeout=seconds + 240) for _ in workers)
    for worker in workers:
        worker.join()
    return total / seconds


def measured(
    process: subprocess.Popen[bytes], url: str, count: int, clients: int, seconds: float
) -> tuple[float, float]:
    """``(steps/s, server CPU microseconds per step)``; the server's CPU includes its workers."""
    from throughput_servers import cpu_seconds, family

    pids = family(process.pid)
    cpu = cpu_seconds(pids)
    steps_per_s = load(url, count, clients, seconds)
    cpu = cpu_seconds(pids) - cpu
    return steps_per_s, 1e6 * cpu / max(1.0, steps_per_s * seconds)


def over_network(
    sessions: list[int], clients: int, seconds: float
) -> dict[int, tuple[float, float]]:
    results: dict[int, tuple[float, float]] = {}
    servers = {kind: start(kind) for kind in ("envhub", "openenv")}
    try:
        for count in sessions:
            runs: dict[str, list[tuple[float, float]]] = {"envhub": [], "openenv": []}
            for _ in range(2):  # alternated: envhub, OpenEnv, envhub, OpenEnv
                for kind, (process, url) in servers.items():
                    runs[kind].append(measured(process, url, count, clients, seconds))
            (hub, hub_cpu), (own, own_cpu) = max(runs["envhub"]), max(runs["openenv"])
            results[count] = (hub, own)
            print(
                f"  {count:5d} sessions: envhub serve {hub:8.0f}  OpenEnv {own:8.0f} steps/s  "
                f"{hub / own:.2f} x; server CPU per step {hub_cpu:.0f} vs {own_cpu:.0f} us",
                flush=True,
            )
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(30)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sessions", default="1,64")
    parser.add_argument("--clients", type=int, default=2)
    args = parser.parse_args()
    print(f"load average: {os.getloadavg()[0]:.2f}", flush=True)
    print("in process (best of rounds):")
    adapted = in_process(args.seconds, args.rounds)
    worst = min(envhub_rate / own for own, envhub_rate in adapted.values())
    print(f"adapter_overhead_worst: {worst:.2f} x")
    print("OpenEnv's client, closed loop (best of 2 alternated runs):")
    counts = [int(c) for c in args.sessions.split(",")]
    network = over_network(counts, args.clients, args.seconds)
    print(f"load average: {os.getloadavg()[0]:.2f}", flush=True)
    hub, own = network[max(counts)]
    print(f"openenv_client_hub_vs_openenv: {hub / own:.2f} x")


if __name__ == "__main__":
    main()
