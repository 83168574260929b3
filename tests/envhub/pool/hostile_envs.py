"""Envs that attack the pool's guarantees (importable by worker processes).

``HostileEnv`` is ``FaultyEnv`` with more ways to misbehave. Constructor switches (through
``env_kwargs``): ``refuse_while`` (a path: building the env raises while that file exists),
``refuse_builds`` (a path: while it exists, each build appends a byte to it and raises until
the file holds ``refusals`` bytes), ``slow_while`` (a path: building blocks while it exists),
``reset_sleep`` / ``reset_raise``. Actions: ``crash``, ``hang``, ``sleep:S``, ``spawn`` (starts
a helper process, its pid in ``info["helper"]``), ``fork`` (forks a lingering helper that
holds the worker's socket, pid likewise), ``rtsig`` (the worker kills itself with real-time
signal 40), ``sysexit`` / ``kbint`` (raise ``SystemExit`` / ``KeyboardInterrupt``), ``big:N``
(an observation of N characters); anything else is echoed.

``RawEnv`` is not a ``TextEnv``: a user env with its own ``step`` whose output is wrong in the
way ``bad`` names (``reward_nan``, ``reward_none``, ``reward_huge`` (1e39: finite, but ``inf``
in float32), ``info_list``, ``messages_str``, ``flag_str``), as the registry accepts any class.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any

import psutil

from envhub.core import TextEnv, Turn
from envhub.registry import EnvSpec

HOSTILE = EnvSpec(
    id="test/hostile-v0", entry_point="tests.envhub.pool.hostile_envs:HostileEnv", max_turns=50
)
RAW = EnvSpec(id="test/raw-v0", entry_point="tests.envhub.pool.hostile_envs:RawEnv")


class HostileEnv(TextEnv):
    def __init__(
        self,
        *,
        refuse_while: str | None = None,
        refuse_builds: str | None = None,
        refusals: int = 0,
        slow_while: str | None = None,
        reset_sleep: float = 0.0,
        reset_raise: bool = False,
        **kwargs: Any,
    ) -> None:
        if refuse_while and os.path.exists(refuse_while):
            raise RuntimeError(f"the env refuses to build while {refuse_while} exists")
        if refuse_builds and os.path.exists(refuse_builds):
            with open(refuse_builds, "ab") as f:
                f.write(b"x")
            if os.path.getsize(refuse_builds) <= refusals:
                raise RuntimeError("the env refuses to build (counted)")
        while slow_while and os.path.exists(slow_while):
            time.sleep(0.05)
        super().__init__(**kwargs)
        self.reset_sleep, self.reset_raise = reset_sleep, reset_raise

    def on_reset(self, options):
        if self.reset_raise:
            raise ValueError("bad task")
        if self.reset_sleep:
            time.sleep(self.reset_sleep)
        return f"pid {os.getpid()}", {"pid": os.getpid()}

    def on_step(self, action):
        if action == "crash":
            os._exit(3)
        if action == "hang":
            time.sleep(3600)
        if action.startswith("sleep:"):
            time.sleep(float(action.split(":", 1)[1]))
        if action == "rtsig":
            os.kill(os.getpid(), 40)
            time.sleep(3600)
        if action == "sysexit":
            raise SystemExit(0)
        if action == "kbint":
            raise KeyboardInterrupt
        if action == "spawn":  # a helper the env owns (a sandbox, a browser)
            helper = subprocess.Popen(["sleep", "300"])
            return Turn("spawned", info={"helper": helper.pid})
        if action == "fork":  # a forked helper ('fork' multiprocessing) holding our socket
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                time.sleep(300)
                os._exit(0)
            return Turn("forked", info={"helper": pid})
        if action.startswith("big:"):
            return Turn("x" * int(action.split(":", 1)[1]))
        return Turn(f"echo {action}", reward=0.5, info={"pid": os.getpid()})


class RawEnv:
    """A user env with its own ``reset``/``step`` returning what ``bad`` says (see above)."""

    def __init__(self, bad: str = "reward_nan") -> None:
        self.bad = bad

    def reset(self, *, seed=None, options=None):
        return [{"role": "user", "content": "go"}], {}

    def step(self, action):
        messages: Any = [{"role": "user", "content": "ok"}]
        reward: Any = 1.0
        info: Any = {}
        terminated: Any = False
        if self.bad == "reward_nan":
            reward = float("nan")
        elif self.bad == "reward_none":
            reward = None
        elif self.bad == "reward_huge":
            reward = 1e39
        elif self.bad == "info_list":
            info = ["not", "a", "dict"]
        elif self.bad == "messages_str":
            messages = "ok"
        elif self.bad == "flag_str":
            terminated = "no"
        return messages, reward, terminated, False, info

    def close(self):
        pass


def register() -> None:
    """Register both ids in the shared registry (sources that take ids build pools by id)."""
    from envhub.registry import register as reg

    reg(HOSTILE.id, HOSTILE.entry_point, max_turns=HOSTILE.max_turns)
    reg(RAW.id, RAW.entry_point)


def survivors(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The pids still running once each had ``timeout`` seconds to end (psutil's wait)."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    out = []
    for proc in alive:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
        except psutil.NoSuchProcess:
            pass
    return out
