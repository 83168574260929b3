"""`envhub train` in a child process that a test SIGKILLs mid-run, for the resume tests.

``envhub_train(..., test_envs=True)`` runs ``python -m tests.trainer.killed_runs train ...``:
the real CLI, after registering two test envs that watch the run they are played in:

    test/frozen-lake-v0   the quickstart's Frozen Lake
    test/point-v0         ``tests.trainer.test_learning.PointEnv`` (one turn, learnt in ~10 steps)

Every ``reset`` of them appends ``pid seed rows`` to ``{run}.resets`` (``rows``: lines of the
run's ``metrics.jsonl`` at that moment, i.e. the last logged step + 1) and, the first time a
reset comes after step ``ENVHUB_TEST_KILL_AFTER_STEP`` was logged, SIGKILLs its own process.
Local envs (``env.pool_workers: 0``) live in the trainer's driver, so that is the process
killed, with every backend (the ``local`` one's threads, or the Ray workers it started). The
kill is driven by the run's own progress, never by a timer. With ``seed: 0`` a training
episode's seed is its group's task number (``trainer.rollout.groups.plan_groups``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from envs.games.frozen_lake import FrozenLakeEnv

REPO = Path(__file__).resolve().parents[2]
MODULE = "tests.trainer.killed_runs"  # (not __name__: that is "__main__" in the child)
RUN_DIR = "ENVHUB_TEST_RUN_DIR"
KILL_AFTER = "ENVHUB_TEST_KILL_AFTER_STEP"


def envhub_train(
    *args: str, cwd: Path, test_envs: bool = False, **env_vars: str
) -> subprocess.Popen[str]:
    """``envhub train ARGS`` in a child process (stdout and stderr together);
    ``test_envs`` registers the envs above first."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env_vars}
    module = MODULE if test_envs else "envhub.cli"
    return subprocess.Popen(
        [sys.executable, "-m", module, "train", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def rows(out: Path) -> list[dict[str, Any]]:
    """The run's ``metrics.jsonl``, one dict per step."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


WALL_CLOCK = ("time_s", "sync/gb_per_s")
"""Metrics that are wall-clock readings, besides every ``timing/*``."""


def comparable(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row without wall-clock values (``time_s``, ``timing/*``, rates)."""
    return {k: v for k, v in row.items() if not k.startswith("timing/") and k not in WALL_CLOCK}


def resets(out: Path) -> list[tuple[int, int, int]]:
    """``(pid, seed, rows logged)`` of every reset of a watched env in the run ``out``."""
    path = out.with_name(out.name + ".resets")
    if not path.exists():
        return []
    return [
        (int(p), int(s), int(n))
        for p, s, n in (line.split() for line in path.read_text().splitlines())
    ]


def latest_checkpoint(out: Path) -> str:
    return (out / "checkpoints" / "latest").read_text().strip()


class _Watched:
    """Mixin: record each reset, SIGKILL this process after the chosen step (module docstring)."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        run = Path(os.environ[RUN_DIR])
        metrics = run / "metrics.jsonl"
        logged = metrics.read_bytes().count(b"\n") if metrics.exists() else 0
        with open(run.with_name(run.name + ".resets"), "a") as record:
            record.write(f"{os.getpid()} {seed} {logged}\n")
        marker = run.with_name(run.name + ".killed")
        if (
            KILL_AFTER in os.environ
            and logged > int(os.environ[KILL_AFTER])
            and not marker.exists()
        ):
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().reset(seed=seed, options=options)  # type: ignore[misc]


class WatchedLake(_Watched, FrozenLakeEnv):
    pass


def __getattr__(name: str) -> Any:
    """``WatchedPoint``, built on first use: ``test_learning`` (``PointEnv``) imports
    ``test_cli``, which imports this module."""
    if name != "WatchedPoint":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from tests.trainer.test_learning import PointEnv

    watched = type("WatchedPoint", (_Watched, PointEnv), {"__module__": __name__})
    globals()["WatchedPoint"] = watched
    return watched


def register_test_envs() -> None:
    import envhub

    lake = envhub.spec("games/frozen-lake-v0")
    envhub.register(
        "test/frozen-lake-v0",
        f"{MODULE}:WatchedLake",
        max_turns=lake.max_turns,
        kwargs=dict(lake.kwargs),
    )
    envhub.register(
        "test/point-v0", f"{MODULE}:WatchedPoint", description="a one-turn direction task (tests)"
    )


if __name__ == "__main__":
    register_test_envs()
    from envhub.cli import main

    main()
