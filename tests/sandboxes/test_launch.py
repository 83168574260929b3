"""How a local sandbox's processes start (``sandboxes/_launch.py``): a bwrap sandbox's first
process is moved into its cgroups from outside while bwrap sets up its mounts, and runs its
command only once it is in them."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from sandboxes import ExecResult, Limits, SandboxError, _etc_view, _host, _isolation
from sandboxes._footprint import collect_stale, default_base_dir
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
            with contextlib.suppress(FileNotFoundError):  # the touch, exiting
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


PROGRAM = """
import os, signal, sys
from sandboxes import Limits
from sandboxes.local import LocalSandbox
sb = LocalSandbox(limits=Limits(wall_time_s=10), isolation="bwrap").start()
assert sb.run("true").exit_code == 0
if sys.argv[1] == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
sb.stop()
"""


def test_the_etc_copies_of_a_process_go_when_it_exits_or_at_gc_when_it_was_killed():
    def copies() -> set[Path]:
        return set(Path(default_base_dir()).glob(f"{_etc_view.PREFIX}*"))

    before = copies()
    subprocess.run([sys.executable, "-c", PROGRAM, "exits"], check=True)
    assert copies() == before
    subprocess.run([sys.executable, "-c", PROGRAM, "killed"], check=False)
    left = copies() - before
    assert len(left) == 1, left
    removed = collect_stale()
    assert [str(p) for p in left] == [r for r in removed if _etc_view.PREFIX in r]
    assert copies() == before


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
