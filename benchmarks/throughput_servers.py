"""The servers benchmarks/hub_throughput.py drives, each started as its own process.

* ``serve_hub``   - ``envhub serve`` configuration (2 worker processes) for one env and backend;
* ``serve_bare``  - a bare FastAPI + uvicorn (uvloop) WebSocket server answering no-op steps
                    in-process: the stack's limit on this machine;
* ``OPENENV_SERVER`` - an OpenEnv echo env, run by the python of a temp venv holding
                    ``openenv-core`` (``openenv_python``).

``start_server`` runs one and waits for its port; ``cpu_seconds`` and ``rss_mib`` account for
its process and children (workers).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from envhub.core import TextEnv, Turn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TOKEN = "bench-token-0123456789"
OPENENV_VENV = Path(tempfile.gettempdir()) / "envhub-bench-openenv-venv"


# ---------------------------------------------------------------------- the env served
class NoopEnv(TextEnv):
    """Answers every action with "ok": measures the hub, not an env."""

    def on_reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "ok", {}

    def on_step(self, action: str) -> Turn:
        return Turn("ok")


# ---------------------------------------------------------------------- servers (subprocess modes)
HUB_MAX_SESSIONS = 16384
"""The hub's session limits in the benchmark: room for the 10,000-session point, all of whose
sessions come from one client (one token, one address)."""


def serve_hub(port: int, env: str, backend: str) -> None:
    import envhub
    from envhub.server.cli import run
    from envhub.server.config import HubConfig

    sys.path.insert(0, str(HERE))
    envhub.register("bench/noop-v0", "throughput_servers:NoopEnv", max_turns=10**9)
    config = HubConfig(
        envs=[env],
        workers=2,
        backend=backend,
        token=TOKEN,
        max_sessions=HUB_MAX_SESSIONS,
        max_sessions_per_client=HUB_MAX_SESSIONS,
    )
    run(config, port=port)


BARE_STEP_RESULT = (
    b'{"terminated":false,"truncated":false,"reward":0.0,'
    b'"observation":[{"role":"user","content":"ok"}],'
    b'"info":{"turn":1,"success":false,"invalid_action":false}}'
)
"""The ``result`` of every step the bare server answers: what the hub sends for a no-op step."""


def serve_bare(port: int) -> None:
    import uvicorn
    from fastapi import FastAPI, WebSocketDisconnect

    app = FastAPI()

    async def ws(websocket: Any) -> None:
        await websocket.accept()
        try:
            while True:
                message = orjson.loads(await websocket.receive_text())
                await websocket.send_text(
                    b"".join(
                        (
                            b'{"type":"step_result","seq":',
                            str(message.get("seq", 0)).encode(),
                            b',"result":',
                            BARE_STEP_RESULT,
                            b"}",
                        )
                    ).decode()
                )
        except WebSocketDisconnect:  # the load generator closed the session
            return

    app.router.add_websocket_route("/ws", ws)
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http="httptools",
        ws="websockets-sansio",
        ws_per_message_deflate=False,
        log_level="error",
        backlog=4096,
    )


OPENENV_SERVER = """
import sys
import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    echoed_message: str


class EchoEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(step_count=0)
        return EchoObservation(echoed_message="ok", done=False, reward=0.0)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        return EchoObservation(echoed_message=action.message, done=False, reward=0.0)

    @property
    def state(self):
        return self._state


app = create_app(EchoEnvironment, EchoAction, EchoObservation, max_concurrent_envs=4096)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="error", backlog=4096)
"""
"""An OpenEnv server equivalent to ``bench/noop-v0``; run as ``python script.py PORT``."""


def openenv_python(venv: Path) -> Path:
    """The temp venv holding ``openenv-core`` (created on first use, kept for reruns)."""
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"installing openenv-core into {venv} (once) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "openenv-core", "uvloop"], check=True
        )
    return python


# ---------------------------------------------------------------------- server processes
class Server:
    """A server subprocess, waited for until its port accepts connections."""

    def __init__(self, command: list[str], port: int, env: dict[str, str] | None = None) -> None:
        self.port = port
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                stderr = self.proc.stderr.read().decode()  # type: ignore[union-attr]
                raise RuntimeError(f"{' '.join(command)} exited: {stderr[-3000:]}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                time.sleep(0.2)
        time.sleep(1.0)  # let workers finish starting
        self.pids = family(self.proc.pid)

    def stop(self) -> None:
        for pid in reversed(family(self.proc.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


def start_server(command: list[str], env: dict[str, str] | None = None) -> Server:
    """Start ``command`` on a free port, which replaces ``{port}`` in its arguments."""
    port = free_port()
    return Server([part.replace("{port}", str(port)) for part in command], port, env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- process accounting
def family(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
                )
            except (OSError, ValueError, IndexError):
                pass
    found, grew = {pid}, True
    while grew:
        grew = False
        for child, parent in parents.items():
            if parent in found and child not in found:
                found.add(child)
                grew = True
    return sorted(found)


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


def open_fds(pid: int) -> int:
    """File descriptors ``pid`` holds now (sockets included)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def hub_state(port: int) -> tuple[int, int]:
    """``(open sessions, live episodes over all pools)`` as the hub itself reports them."""
    import urllib.request

    def get(path: str) -> Any:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            return orjson.loads(answer.read())

    episodes = sum(env["episodes"] for env in get("/v1/envs")["envs"])
    return get("/health")["sessions"], episodes


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            pass
    return total * os.sysconf("SC_PAGE_SIZE") / 2**20
