"""How a local sandbox's processes start (``sandboxes/_launch.py``): a bwrap sandbox's first
process is moved into its cgroups from outside while bwrap sets up its mounts, and runs its
command only once it is in them."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from sandboxes import ExecResult, Limits, SandboxError, _etc_view, _host, _isolation, _launch
from sandboxes._footprint import collect_stale
from sandboxes.local import LocalSandbox
from tests.sandboxes.conftest import _local_skip_reason

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or bool(_local_skip_reason("bwrap")),
    reason="cgroups need root; the gate is bwrap's",
)


def test_a_sandbox_that_cannot_join_its_cgroup_never_runs_its_command():
    with LocalSandbox(limits=Limits(wall_time_s=10), isolation="bwrap") as sb:
        cgroup = sb._run_cgroup
        assert cgroup is not None
        cgroup.dirs["pids"].rmdir()
        moved = r"could not move the sandbox into its cgroup .*pids"
        with pytest.raises(SandboxError, match=moved):
            sb.run("touch /sandbox/ran")
        assert not (sb.dir / "scratch" / "ran").exists()
        assert cgroup.pids() == set()


def test_a_warm_sandbox_whose_executor_cannot_join_its_cgroup_does_not_start(monkeypatch):
    missing = "/sys/fs/cgroup/pids/envhub-no-such-cgroup/cgroup.procs"
    real = _host.Cgroup.procs_files
    monkeypatch.setattr(
        _host.Cgroup, "procs_files", property(lambda self: [*real.fget(self), missing])
    )
    before = set(Path("/dev/shm").glob("envhub-sbx-*"))
    with pytest.raises(SandboxError, match="could not move the sandbox into its cgroup"):
        LocalSandbox(limits=Limits(wall_time_s=10), isolation="bwrap", warm_exec=True).start()
    assert set(Path("/dev/shm").glob("envhub-sbx-*")) == before  # nothing left behind


def test_a_launch_whose_bwrap_fails_in_its_setup_reports_bwrap_and_leaves_nothing():
    extra = Path(tempfile.mkdtemp(prefix="envhub-test-bind-"))  # the sandbox uid reaches /tmp
    os.chmod(extra, 0o755)
    limits = Limits(wall_time_s=10)
    with LocalSandbox(limits=limits, isolation="bwrap", ro_binds=[str(extra)]) as sb:
        extra.rmdir()  # bwrap's child fails to bind it, after bwrap reported the child
        r = sb.run("echo should-not-run")
        assert r.exit_code != 0 and "should-not-run" not in r.stdout, r
        assert "bwrap" in r.stderr and str(extra) in r.stderr, r
        assert sb._run_cgroup is not None and sb._run_cgroup.pids() == set()
        extra.mkdir(mode=0o755)
        assert sb.run("echo runs").stdout == "runs\n"
    extra.rmdir()


def test_the_command_runs_in_the_sandbox_cgroups():
    with LocalSandbox(limits=Limits(wall_time_s=10), isolation="bwrap") as sb:
        cgroup = sb._run_cgroup
        assert cgroup is not None
        started = sb.dir / "scratch" / "started"
        script = "touch started; while [ -e started ]; do :; done; echo done"
        result: list[ExecResult] = []
        thread = threading.Thread(target=lambda: result.append(sb.run(script)))
        thread.start()
        while not started.exists() and thread.is_alive():
            os.sched_yield()
        names = set()
        for pid in cgroup.pids():
            with contextlib.suppress(OSError):  # the touch, exiting (ENOENT or ESRCH)
                names.add(Path(f"/proc/{pid}/comm").read_text().strip())
        started.unlink()
        thread.join()
        assert result and result[0].stdout == "done\n", result
        assert "sh" in names, names  # the command's shell, seen in the memory and pids cgroups


def test_an_etc_file_changed_on_the_host_shows_in_the_next_sandbox(monkeypatch):
    """``/etc`` is one prepared copy (``_etc_view.py``): a source changed since the copy was
    made (a package install rewrote ``ld.so.cache``, an admin edited ``hosts``) is copied
    again for the next launch."""
    name = f"envhub-test-{os.getpid()}"
    source = Path("/etc", name)
    monkeypatch.setattr(_isolation, "ETC_FILES", (*_isolation.ETC_FILES, name))
    held = set(_etc_view._held)
    try:
        source.write_text("first\n")
        with LocalSandbox(limits=Limits(wall_time_s=10), isolation="bwrap") as sb:
            assert sb.run(f"cat /etc/{name}").stdout == "first\n"
            source.write_text("second, longer\n")
            assert sb.run(f"cat /etc/{name}").stdout == "second, longer\n"
            assert sb.run("cat /etc/passwd").stdout.startswith("root:x:0:0:")
            assert "Read-only" in sb.run(f"echo x > /etc/{name}").stderr
    finally:
        source.unlink()
        _release_copies_made_since(held, remove=True)  # with this test's file: nobody else's


def _release_copies_made_since(held: set[tuple[object, ...]], *, remove: bool) -> None:
    """Let go of the /etc copies this process took since ``held`` (a test's own)."""
    for key in set(_etc_view._held) - held:
        fd, etc = _etc_view._held.pop(key)
        os.close(fd)
        if remove:
            shutil.rmtree(etc.parent, ignore_errors=True)


PROGRAM = """
import os, signal, sys
from sandboxes import Limits
from sandboxes.local import LocalSandbox
sb = LocalSandbox(limits=Limits(wall_time_s=10), isolation="bwrap", base_dir=sys.argv[2]).start()
assert sb.run("true").exit_code == 0
if sys.argv[1] == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
sb.stop()
"""


def test_processes_share_one_etc_copy_which_gc_removes_once_none_holds_it():
    base = Path(tempfile.mkdtemp(prefix="envhub-test-base-"))
    os.chmod(base, 0o755)  # the sandbox uid reaches its scratch and /etc through it

    def copies() -> list[Path]:
        return list(base.glob(f"{_etc_view.PREFIX}*"))

    try:
        subprocess.run([sys.executable, "-c", PROGRAM, "exits", str(base)], check=True)
        subprocess.run([sys.executable, "-c", PROGRAM, "killed", str(base)], check=False)
        [copy] = copies()  # one per content, whoever made or used it
        limits = Limits(wall_time_s=10)
        held = set(_etc_view._held)
        with LocalSandbox(limits=limits, isolation="bwrap", base_dir=str(base)) as sb:
            assert sb.run("cat /etc/passwd").stdout.startswith("root:x:0:0:")
            assert str(copy) not in collect_stale(str(base))  # held by this process
        assert copies() == [copy]
        _release_copies_made_since(held, remove=False)  # as if this process had exited
        assert str(copy) in collect_stale(str(base))
        assert copies() == []
        assert list(base.iterdir()) == []  # the killed owner's sandbox is gone too
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("path", ["/etc/ssl", "/etc/ssl/certs", "/etc/hosts"])
def test_a_read_only_bind_under_etc_shows_the_host_entry(path):
    """``ro_binds`` under ``/etc`` are bound over the read-only copy: each needs a place to be
    mounted on there (bwrap failed "Can't mkdir /etc/ssl: Read-only file system")."""
    if not os.path.exists(path):
        pytest.skip(f"this host has no {path}")
    with LocalSandbox(limits=Limits(wall_time_s=10), isolation="bwrap", ro_binds=[path]) as sb:
        if os.path.isdir(path):
            r = sb.run(["ls", "-A", path])
            assert r.ok and sorted(r.stdout.split()) == sorted(os.listdir(path)), r
        else:
            r = sb.run(["cat", path])
            assert r.ok and r.stdout == Path(path).read_text(), r


DIES_WHILE_LAUNCHING = """
import json, os, signal, sys
from sandboxes import Limits, _launch
from sandboxes.local import LocalSandbox
point = sys.argv[1]
moves = []
real_move, real_child_pid = _launch._CgroupGate._move, _launch._CgroupGate._child_pid
def move(pid, cgroup):
    moves.append(pid)
    if point == "before the child's move" and len(moves) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_move(pid, cgroup)
def child_pid(self, proc):
    if point == "before bwrap's report":
        os.kill(os.getpid(), signal.SIGKILL)
    return real_child_pid(self, proc)
_launch._CgroupGate._move = staticmethod(move)
_launch._CgroupGate._child_pid = child_pid
sb = LocalSandbox(limits=Limits(wall_time_s=10), isolation="bwrap").start()
print(json.dumps({"scratch": str(sb.dir / "scratch"), "uid": sb.uid}), flush=True)
sb.run("touch /sandbox/ran; sleep 30")
"""


def test_a_sandbox_whose_owner_never_lets_it_go_runs_nothing(monkeypatch):
    """The sandbox's PID 1 runs the command only after its owner's ``go`` (sent once the
    process is in its cgroups); end of file instead (its owner died) runs nothing, where
    bwrap took end of file on ``--block-fd`` for go."""
    monkeypatch.setattr(_launch, "GO", b"")  # the owner writes nothing, then its end closes
    with LocalSandbox(limits=Limits(wall_time_s=10), isolation="bwrap") as sb:
        r = sb.run("touch /sandbox/ran")
        assert r.exit_code == 125 and not (sb.dir / "scratch" / "ran").exists(), r


@pytest.mark.parametrize("point", ["before bwrap's report", "before the child's move"])
def test_gc_clears_what_an_owner_killed_while_launching_left(point):
    """Killed before bwrap reported its child, the owner leaves bwrap's monitor to die of
    SIGPIPE and its child waiting forever; killed before the child's move, a child outside
    its cgroups: ``envhub sandbox gc`` kills every process of the dead owner's sandbox uid."""
    out = subprocess.run(
        [sys.executable, "-c", DIES_WHILE_LAUNCHING, point],
        check=False,
        capture_output=True,
        text=True,
    )
    assert out.returncode == -signal.SIGKILL, out
    left = json.loads(out.stdout)
    collect_stale()
    assert not Path(left["scratch"]).exists()
    assert _processes_of(left["uid"]) == [], "gc left a process of the sandbox running"


def _processes_of(uid: int) -> list[str]:
    """The names of the processes whose real uid is ``uid``."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(OSError):
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines())
            if fields["Uid"].split()[0] == str(uid):
                found.append(fields["Name"].strip())
    return found


def test_a_launch_goes_on_while_a_forked_process_holds_the_report_pipe(monkeypatch):
    """A process forked (without exec) in another thread during a launch holds the write end
    of bwrap's report pipe: the owner reads the report, not up to end of file (the launch
    failed after 30 s: "bwrap did not start its sandbox")."""
    held: list[int] = []
    gate_init = _launch._CgroupGate.__init__

    def init(self: _launch._CgroupGate) -> None:
        gate_init(self)
        held.append(os.dup(self.child_fds[0]))  # as a fork at that moment would

    monkeypatch.setattr(_launch._CgroupGate, "TIMEOUT_S", 5.0)
    monkeypatch.setattr(_launch._CgroupGate, "__init__", init)
    try:
        with LocalSandbox(limits=Limits(wall_time_s=10), isolation="bwrap") as sb:
            assert sb.run("echo ran").stdout == "ran\n"
    finally:
        for fd in held:
            os.close(fd)


def test_the_first_sandbox_a_process_starts_gives_back_what_a_killed_one_left():
    """Self-healing: a trainer or hub killed with its sandboxes running leaves their processes,
    cgroups, uids and directories; the next process to start a sandbox gives them back."""
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_WITH_A_COMMAND_RUNNING],
        check=False,
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed
    left = json.loads(killed.stdout)
    assert Path(left["dir"]).exists() and _processes_of(left["uid"]), "nothing was left"
    starts = "from sandboxes.local import LocalSandbox\nLocalSandbox().start().stop()"
    subprocess.run([sys.executable, "-c", starts], check=True)
    assert not Path(left["dir"]).exists()
    assert _processes_of(left["uid"]) == []


KILLED_WITH_A_COMMAND_RUNNING = """
import json, os, signal, threading
from sandboxes import Limits
from sandboxes.local import LocalSandbox
sb = LocalSandbox(limits=Limits(wall_time_s=60), isolation="bwrap").start()
threading.Thread(target=sb.run, args=("touch /sandbox/started; sleep 50",), daemon=True).start()
while not (sb.dir / "scratch" / "started").exists():
    os.sched_yield()
print(json.dumps({"dir": str(sb.dir), "uid": sb.uid}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_an_etc_copy_another_user_planted_at_the_shared_name_is_not_used():
    """The copies' names are predictable and their base (``/dev/shm``, ``/tmp``) writable by
    every user of the host: one not made by this uid must never become a sandbox's /etc."""
    base = Path(tempfile.mkdtemp(prefix="envhub-test-base-"))
    os.chmod(base, 0o755)
    held = set(_etc_view._held)
    limits = Limits(wall_time_s=10)
    try:
        with LocalSandbox(limits=limits, isolation="bwrap", base_dir=str(base)) as sb:
            assert sb.run("true").ok
        [copy] = base.glob(f"{_etc_view.PREFIX}*")
        _release_copies_made_since(held, remove=False)
        (copy / "etc" / "passwd").write_text("planted:x:0:0::/:/bin/sh\n")
        for path in (copy, copy / "etc", copy / "etc" / "passwd", copy / "lock"):
            os.chown(path, 12345, 12345)  # as if another user had made it first
        with LocalSandbox(limits=limits, isolation="bwrap", base_dir=str(base)) as sb:
            assert sb.run("cat /etc/passwd").stdout.startswith("root:x:0:0:")
    finally:
        _release_copies_made_since(held, remove=False)
        shutil.rmtree(base, ignore_errors=True)


def test_a_stop_while_a_run_is_still_launching_kills_the_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``stop()`` from another thread sweeps the run cgroup and the recorded process, then waits
    for the run: a command still being launched then (not in the cgroup yet, not recorded) was
    missed and slept out (the contract test caught it about once in 50 runs, stopping as soon as
    the launcher's argv showed the command)."""
    with LocalSandbox(limits=Limits(wall_time_s=60), isolation="bwrap") as sb:
        launching, swept = threading.Event(), threading.Event()
        popen, kill_running = sb._popen, sb._kill_running

        def slow_popen(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
            launching.set()
            swept.wait(30)  # stop() sweeps now, before the command exists
            return popen(*args, **kwargs)  # type: ignore[arg-type]

        def sweep() -> None:
            kill_running()
            swept.set()

        monkeypatch.setattr(sb, "_popen", slow_popen)
        monkeypatch.setattr(sb, "_kill_running", sweep)
        results: list[ExecResult] = []
        runner = threading.Thread(target=lambda: results.append(sb.run("sleep 20")))
        runner.start()
        assert launching.wait(30), "the run never started launching"
        sb.stop()
        runner.join(60)
        assert results and not results[0].ok, results  # killed, not slept out (exit 0)
