"""Warm pools: hand-out, recycling, replacement of broken sandboxes, no leaks on shutdown."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from sandboxes import Limits, PoolClosedError, SandboxError, SandboxPool
from sandboxes.local import LocalSandbox
from tests.sandboxes.conftest import USR_RO, _local_skip_reason

pytestmark = pytest.mark.skipif(
    bool(_local_skip_reason("bwrap") and _local_skip_reason("unshare")),
    reason="no local isolation here (needs bubblewrap or root)",
)
LIMITS = Limits(wall_time_s=5, memory_mb=128, max_processes=32)


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_pool_hands_out_started_sandboxes_and_recycles_them_clean():
    with SandboxPool("local", size=2, limits=LIMITS) as pool:
        assert pool.idle == 2
        with pool.acquire() as sb:
            assert sb.started
            sb.write_file("left-behind.txt", "x")
            session = sb.session("bash")
            assert session.run("echo hi").stdout == "hi\n"
            first = sb
        assert wait_for(lambda: pool.idle == 2)
        seen = set()
        for _ in range(4):
            with pool.acquire() as sb:
                seen.add(sb.id)
                assert sb.run("ls -A").stdout == "", "a recycled sandbox must have an empty scratch"
        assert first.id in seen and not session.alive
        assert pool.replaced == 0


def test_parallel_users_share_a_small_pool():
    results: list[bool] = []
    with SandboxPool("local", size=2, limits=LIMITS) as pool:

        def worker() -> None:
            for i in range(5):
                with pool.acquire(timeout=30) as sb:
                    r = sb.run(["python3", "-c", f"print({i} * 2)"])
                    results.append(r.ok and r.stdout == f"{i * 2}\n")

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results == [True] * 20


def test_attacks_through_the_pool_leave_it_working():
    with SandboxPool("local", size=2, limits=LIMITS) as pool:
        attacks = [
            "b() { b | b & }; b",
            "python3 -c 'a = []\nwhile True: a.append(bytearray(1 << 24))'",
            "while :; do :; done",
            "yes | head -c 100000000",
        ]
        for attack in attacks:
            with pool.acquire() as sb:
                r = sb.run(attack, timeout=2)
                assert r.wall_time_s < 2 + 5, (attack, r.describe())
        for _ in range(2):
            with pool.acquire() as sb:
                assert sb.run("echo fine").stdout == "fine\n"
        assert pool.replaced == 0


def test_a_broken_sandbox_is_replaced():
    with SandboxPool("local", size=1, limits=LIMITS) as pool:
        with pytest.raises(SandboxError), pool.acquire() as sb:
            broken_id = sb.id
            sb.stop()  # e.g. its container died under it
            sb.run("true")  # -> SandboxStateError, a SandboxError: the pool replaces it
        assert wait_for(lambda: pool.idle == 1)
        assert pool.replaced == 1
        with pool.acquire() as sb:
            assert sb.id != broken_id and sb.run("echo ok").stdout == "ok\n"


def test_acquire_times_out_and_refuses_after_close():
    pool = SandboxPool("local", size=1, limits=LIMITS)
    with (
        pool.acquire(),
        pytest.raises(SandboxError, match="no local sandbox free within 0.2 s"),
        pool.acquire(timeout=0.2),
    ):
        pass
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(PoolClosedError, match="closed"), pool.acquire():
        pass


def test_close_leaks_nothing_even_with_sandboxes_handed_out():
    pool = SandboxPool("local", size=3, limits=LIMITS)
    handed_out = pool.acquire()
    sb = handed_out.__enter__()
    sb.session("python").run("x = 1")
    sandboxes = list(pool._all)
    dirs = [s.dir for s in sandboxes if isinstance(s, LocalSandbox)]
    cgroups = [
        p
        for s in sandboxes
        if isinstance(s, LocalSandbox) and s._cgroup
        for p in s._cgroup.dirs.values()
    ]
    pool.close()
    assert not sb.started and all(not s.started for s in sandboxes)
    assert not any(Path(d).exists() for d in dirs), "sandbox dirs left behind"
    assert not any(p.exists() for p in cgroups), "cgroups left behind"
    scratch_mounts = [
        line
        for line in Path("/proc/self/mounts").read_text().splitlines()
        if any(str(d) in line for d in dirs)
    ]
    assert not scratch_mounts, scratch_mounts
    with pytest.raises(SandboxError):
        sb.run("true")


@pytest.mark.docker
def test_docker_pool_recycles_and_removes_its_containers(docker_engine, docker_image):
    import docker

    with SandboxPool(
        "docker", size=2, limits=LIMITS, image=docker_image, base_url=docker_engine, volumes=USR_RO
    ) as pool:
        ids = {s.id for s in pool._all}
        with pool.acquire() as sb:
            sb.run("echo x > f")
        with pool.acquire() as a, pool.acquire() as b:
            assert a.run("ls -A").stdout == "" and b.run("ls -A").stdout == ""
    client = docker.DockerClient(base_url=docker_engine)
    left = [c for c in client.containers.list(all=True) if c.labels.get("envhub.sandbox") in ids]
    client.close()
    assert not left, "the pool left containers behind"


@pytest.mark.docker
def test_docker_exec_not_yet_started_is_not_taken_for_finished(
    docker_engine, docker_image, monkeypatch
):
    """The engine reports an exec that has not started yet as ``Running: False`` with no exit
    code; on a loaded host the first poll can see that. Such a run must not be killed as if its
    program had exited (it was: exit 137, not timed out, in a fresh-clone CI run)."""
    from sandboxes.docker import DockerSandbox

    with DockerSandbox(image=docker_image, base_url=docker_engine, volumes=USR_RO) as sandbox:
        real = sandbox.api.exec_inspect
        polls = {"n": 0}

        def not_started_yet(exec_id):
            info = real(exec_id)
            polls["n"] += 1
            if polls["n"] <= 3 and info.get("Running"):  # what the engine says before the start
                return {**info, "Running": False, "ExitCode": None}
            return info

        monkeypatch.setattr(sandbox.api, "exec_inspect", not_started_yet)
        result = sandbox.run("sleep 0.5; echo done", timeout=10)
    assert polls["n"] > 0 and result.ok and result.stdout == "done\n", result
