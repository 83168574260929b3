"""``envhub serve`` as a user starts and stops it: a port in use is one line naming the fix,
Ctrl-C says what the drain waits for, a second Ctrl-C stops at once (exit 130), and a client in
the middle of an episode learns the hub is gone instead of trying to resume."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "fastapi", reason="the server extra is not installed (pip install -e '.[server]')"
)

import signal
import socket
import subprocess
import sys

from envhub.client import RemoteEnv
from envhub.server.errors import SessionLostError
from tests.envhub.server.hubtools import envhub_serve

TOKEN = "stop-test-token-42"
ENV = "games/guess-number-v0"


def test_a_port_in_use_is_refused_before_saying_serving() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "envhub.cli", "serve", "--env", ENV, "--no-auth",
             "--port", str(port)],
            check=False, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "serving" not in done.stderr and "ERROR" not in done.stderr
    assert f"error: cannot listen on 127.0.0.1:{port} (" in done.stderr
    assert done.stderr.strip().endswith("pick another --port")
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def lines_until(proc: subprocess.Popen, word: str) -> str:
    """What the hub prints up to and including its first line holding ``word``."""
    seen = ""
    while word not in seen:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, f"the hub exited before printing {word!r}: {seen}"
        seen += line
    return seen


def test_ctrl_c_says_what_it_waits_for_and_a_second_stops_now_telling_clients() -> None:
    with envhub_serve("--env", ENV, "--workers", "1", "--drain-timeout", "600", token=TOKEN) as (
        proc,
        port,
    ):
        playing = RemoteEnv(ENV, f"ws://127.0.0.1:{port}", token=TOKEN, resume_timeout_s=600)
        playing.reset(seed=0)  # an episode is running: the drain would wait for it
        proc.send_signal(signal.SIGINT)
        draining = lines_until(proc, "draining").splitlines()[-1]
        assert "1 episode running" in draining
        assert "up to 600 s (--drain-timeout)" in draining and "Ctrl-C again" in draining
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
        rest = proc.stdout.read()  # type: ignore[union-attr]
        assert "stopped" in rest and "Aborted" not in rest, rest
        with pytest.raises(SessionLostError) as lost:
            playing.step("<answer>50</answer>")
        assert lost.value.code == "draining", lost.value  # told, not left to resume for 600 s
