"""Docker-only properties: the engine and the container's owner as things that fail.

The backend-parametrized suites (``test_adversarial.py``, ``test_reuse.py``,
``test_contract.py``) attack what a *program* can do; these tests break what only the docker
backend depends on: the process that owns the container dies, the engine hangs or restarts.
Each uses the private engine of ``conftest.py`` (a throwaway dockerd of this test session).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes import Limits, SandboxError
from sandboxes.docker import DockerSandbox
from sandboxes.dockerd import HOST_USR_RO
from tests.helpers import host_processes_with
from tests.sandboxes.conftest import TEST_IMAGE

pytestmark = pytest.mark.docker
docker = pytest.importorskip("docker", reason="docker SDK missing: pip install 'envhub[docker]'")

PROJECT = Path(__file__).resolve().parents[2]

OWNER = """\
import sys
from sandboxes.docker import DockerSandbox
from sandboxes.dockerd import HOST_USR_RO
sb = DockerSandbox(image=sys.argv[1], base_url=sys.argv[2], volumes=HOST_USR_RO).start()
print(sb.container.id, flush=True)
sys.stdin.read()
"""


def destroyed_within(client, container_id: str, since: float, seconds: float) -> bool:
    """Whether the engine reports the container destroyed (now, or within ``seconds``)."""
    events = client.events(
        since=int(since) - 1,
        until=int(time.time() + seconds),
        filters={"container": container_id, "event": "destroy"},
        decode=True,
    )
    try:
        return any(True for _ in events)
    finally:
        events.close()


@pytest.mark.parametrize("signal_number", [signal.SIGKILL, signal.SIGTERM], ids=["kill", "term"])
def test_container_is_removed_when_its_owner_is_killed(docker_engine, docker_image, signal_number):
    """A process killed before it could stop its sandbox (no ``atexit`` runs on SIGKILL, nor on
    an unhandled SIGTERM) must not leave a container running on the engine."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, docker_image, docker_engine],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=PROJECT,
        text=True,
    )
    container_id = owner.stdout.readline().strip()  # type: ignore[union-attr]
    assert container_id, "the owner did not start a sandbox"
    client = docker.DockerClient(base_url=docker_engine, timeout=60)
    try:
        assert client.containers.list(filters={"id": container_id})
        since = time.time()
        owner.send_signal(signal_number)
        owner.wait()
        assert destroyed_within(client, container_id, since, 30), "the container outlived its owner"
        assert not client.containers.list(all=True, filters={"id": container_id})
    finally:
        owner.kill()
        owner.wait()
        for leftover in client.containers.list(all=True, filters={"id": container_id}):
            leftover.remove(force=True)
        client.close()


class Engine:
    """A private dockerd this test may hang, stop and restart (the session's is shared)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.root = Path(url.removeprefix("unix://")).parent
        self.pid = int((self.root / "d.pid").read_text())
        self.argv = Path(f"/proc/{self.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        self.restarted: subprocess.Popen[bytes] | None = None

    def signal(self, signal_number: int) -> None:
        os.kill(self.pid, signal_number)

    def stop(self) -> None:
        """SIGTERM it (as ``systemctl stop docker`` does) and wait until it has exited."""
        fd = os.pidfd_open(self.pid)
        try:
            os.kill(self.pid, signal.SIGTERM)
            assert select.select([fd], [], [], 60)[0], "dockerd did not exit within 60 s"
        finally:
            os.close(fd)
        if self.restarted is not None:
            self.restarted.wait()

    def start(self) -> None:
        """Start it again with the same data root and socket; return once it answers."""
        log = open(self.root / "dockerd-again.log", "wb")  # noqa: SIM115 - kept by the process
        self.restarted = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.pid = self.restarted.pid
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                docker.DockerClient(base_url=self.url, timeout=10).close()  # it pings
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.2)  # polling readiness: dockerd offers no event for it

    def close(self) -> None:
        """Stop a dockerd this object restarted (``private_dockerd`` stops only the first)."""
        if self.restarted is not None and self.restarted.poll() is None:
            self.stop()


@pytest.fixture
def engine(docker_engine) -> Iterator[Engine]:
    """A private engine of its own, with the test image."""
    from sandboxes.dockerd import import_host_image, private_dockerd

    with private_dockerd() as url:
        import_host_image(url, TEST_IMAGE)
        own = Engine(url)
        try:
            yield own
        finally:
            own.signal(signal.SIGCONT) if own.restarted is None else None
            own.close()


def sandbox_on(engine: Engine, **limits: object) -> DockerSandbox:
    return DockerSandbox(
        limits=Limits(**{"wall_time_s": 5.0, **limits}),  # type: ignore[arg-type]
        image=TEST_IMAGE,
        base_url=engine.url,
        volumes=HOST_USR_RO,
    ).start()


def run_in_thread(sb: DockerSandbox, command: str, timeout: float) -> tuple[threading.Thread, list]:
    """``sb.run(command)`` in a thread; the list gets its result or the exception it raised."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(sb.run(command, timeout=timeout))
        except Exception as e:  # noqa: BLE001 - what the test looks at
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    marker = command.split()[-1]
    deadline = time.monotonic() + 30
    while not host_processes_with(f"sleep {marker}") and time.monotonic() < deadline:
        time.sleep(0.02)  # waiting for the command to really run, not a guessed delay
    assert host_processes_with(f"sleep {marker}"), "the command never started"
    return thread, outcome


def test_a_run_ends_by_its_deadline_when_the_engine_hangs(engine, monkeypatch):
    """With the engine hung (SIGSTOPped), ``run(timeout=2)`` does not wait for it to come back:
    it raises ``SandboxError`` soon after its deadline, or reports the timeout; never success.
    (The grace given a hung engine, ``ENGINE_GRACE_S``, is 3 s here instead of 10.)"""
    from sandboxes import _docker_exec

    monkeypatch.setattr(_docker_exec, "ENGINE_GRACE_S", 3.0)
    sb = sandbox_on(engine)
    try:
        marker = f"40.{time.time_ns() % 10**6}"
        thread, outcome = run_in_thread(sb, f"sleep {marker}", timeout=2)
        engine.signal(signal.SIGSTOP)
        thread.join(timeout=2 + 30)  # generous: the defect returned after 130-150 s
        engine.signal(signal.SIGCONT)
        assert not thread.is_alive(), "run() waited for the hung engine"
        (result,) = outcome
        if not isinstance(result, SandboxError):
            assert result.timed_out and not result.ok, result
    finally:
        engine.signal(signal.SIGCONT)
        sb.stop()


def test_an_engine_restart_is_an_error_and_stop_while_down_still_removes(engine):
    """A run the engine restarts under is a ``SandboxError`` (not exit 137 with no flag); a run
    while it is down says to start dockerd or set DOCKER_HOST; ``stop()`` while it is down
    returns, and the container is gone once the engine is back."""
    sb = sandbox_on(engine, wall_time_s=60)
    container_id = sb.container.id
    marker = f"50.{time.time_ns() % 10**6}"
    thread, outcome = run_in_thread(sb, f"sleep {marker}", timeout=60)
    engine.stop()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert isinstance(outcome[0], SandboxError), outcome
    with pytest.raises(SandboxError) as down:
        sb.run("echo hi", timeout=5)
    assert "dockerd" in str(down.value) and "DOCKER_HOST" in str(down.value), down.value
    sb.stop()
    engine.start()
    client = docker.DockerClient(base_url=engine.url, timeout=30)
    try:
        assert not client.containers.list(all=True, filters={"id": container_id}), (
            "the container stop() could not remove is still there after the engine came back"
        )
    finally:
        client.close()


def test_a_pool_replaces_a_sandbox_whose_clean_up_a_run_stopped(docker_engine, docker_image):
    """A run that stops its own clean-up (``kill(-1, SIGSTOP)`` in a loop) costs its user a
    ``SandboxError``; the pool's next user gets a fresh container at once, and nothing of the
    compromised one is left after ``close()``."""
    from sandboxes import SandboxPool
    from tests.sandboxes.test_adversarial import STOP_EVERYTHING

    marker = f"stopper-{time.time_ns()}"
    pool = SandboxPool(
        "docker",
        size=1,
        limits=Limits(wall_time_s=3, cpu_time_s=2),
        image=docker_image,
        base_url=docker_engine,
        volumes=HOST_USR_RO,
    )
    with pool:
        with pytest.raises(SandboxError, match="compromised"), pool.acquire() as sb:
            first = sb.container.id
            sb.run(["python3", "-c", STOP_EVERYTHING, marker], timeout=3)
        with pool.acquire(timeout=60) as sb:
            assert sb.container.id != first
            r = sb.run(["echo", "next user"], timeout=20)
            assert r.ok and r.stdout == "next user\n", r
    assert not host_processes_with(marker), host_processes_with(marker)
    client = docker.DockerClient(base_url=docker_engine, timeout=30)
    try:
        assert not client.containers.list(all=True, filters={"id": first})
    finally:
        client.close()
