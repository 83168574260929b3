"""The Sandbox contract on every backend that runs here: running, files, sessions, lifecycle."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from sandboxes import (
    ExecResult,
    Limits,
    SandboxConfigError,
    SandboxFileError,
    SandboxStateError,
    SessionError,
    make_sandbox,
)


def test_run_argv_shell_stdin_env_and_files(make_sandbox_for):
    sb = make_sandbox_for()
    r = sb.run(["python3", "-c", "print(1)"])
    assert r.ok and r.stdout == "1\n" and r.stderr == "" and r.exit_code == 0 and r.wall_time_s > 0
    r = sb.run("echo hi | tr a-z A-Z; echo oops >&2; exit 3")
    assert (r.stdout, r.stderr, r.exit_code, r.ok) == ("HI\n", "oops\n", 3, False)
    assert sb.run("cat", stdin="piped in").stdout == "piped in"
    r = sb.run('echo "$GREETING $HOME"; pwd', env={"GREETING": "hello"})
    assert r.stdout == f"hello {sb.workdir}\n{sb.workdir}\n"
    r = sb.run(
        ["python3", "main.py"],
        files={"main.py": "import helper\nprint(helper.X)", "helper.py": "X = 7"},
    )
    assert r.stdout == "7\n", r


def test_run_code_and_files_round_trip(make_sandbox_for):
    sb = make_sandbox_for()
    assert sb.run_code("print(2 + 2)").stdout == "4\n"
    assert sb.run_code("echo $((6 * 7))", language="bash").stdout == "42\n"
    sb.write_file("pkg/data.bin", b"\x00\xffbytes")
    sb.write_file(f"{sb.workdir}/abs.txt", "absolute under scratch")
    assert sb.read_bytes("pkg/data.bin") == b"\x00\xffbytes"
    assert sb.read_file("abs.txt") == "absolute under scratch"
    assert sb.run("cat abs.txt").stdout == "absolute under scratch"
    sb.run("echo made-inside > inside.txt")
    assert sb.read_file("inside.txt") == "made-inside\n"
    with pytest.raises(SandboxFileError, match="does not exist|not a readable"):
        sb.read_file("missing.txt")
    for bad in ("../escape.txt", "/etc/passwd", "a/../../b", ""):
        with pytest.raises(SandboxFileError):
            sb.write_file(bad, "x")


def test_a_directory_a_full_scratch_cannot_make_is_scratch_full():
    """Out of room (tmpfs: out of inodes) while making a file's directory: the same
    ``ScratchFullError`` naming the limit as for the file itself, not a bare ``OSError``."""
    from sandboxes import ScratchFullError, _host

    root = Path(os.environ.get("TMPDIR", "/tmp"))
    made = []

    def no_room(name, *args, **kwargs):
        made.append(name)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_host.os, "mkdir", no_room)
        with pytest.raises(ScratchFullError, match="raise Limits.disk_mb"):
            _host.write_at(root, ("envhub-no-such-dir", "x.txt"), b"x", owner=None)
    assert made == ["envhub-no-such-dir"]


def test_bash_session_keeps_state_and_survives_a_timeout(make_sandbox_for):
    sb = make_sandbox_for()
    with sb.session("bash") as shell:
        assert shell.run("cd /tmp && export X=5 && f() { echo f$1; }").ok
        r = shell.run("echo $X; pwd; f 1")
        assert r.stdout == "5\n/tmp\nf1\n", r
        assert shell.run("exit_code_test() { return 4; }; exit_code_test").exit_code == 4
        # broken syntax is an error, not a hang
        assert shell.run("echo 'unterminated").exit_code != 0
        r = shell.run("sleep 30", timeout=1)
        assert r.timed_out and r.exit_code != 0
        assert shell.run("echo $X").stdout == "5\n", "state must survive an interrupted command"
        assert shell.restarts == 0
        r = shell.run("cat")  # stdin is /dev/null, so this cannot swallow the protocol
        assert r.ok and r.stdout == ""


def test_python_session_keeps_state_and_interrupts(make_sandbox_for):
    sb = make_sandbox_for()
    with sb.session("python") as py:
        assert py.run("import math\nx = 41").ok
        assert py.run("x + 1").stdout == "42\n"
        r = py.run("1 / 0")
        assert r.exit_code == 1 and "ZeroDivisionError" in r.stderr
        r = py.run("while True: pass", timeout=1)
        assert r.timed_out
        assert py.run("print(math.sqrt(x + 8))").stdout == "7.0\n"


def test_lifecycle_errors_are_clear(make_sandbox_for):
    sb = make_sandbox_for()
    sb.stop()
    sb.stop()  # idempotent
    with pytest.raises(SandboxStateError, match="make a new sandbox"):
        sb.run("true")
    with pytest.raises(SandboxStateError, match="not restartable"):
        sb.start()


def test_reset_empties_scratch(make_sandbox_for):
    sb = make_sandbox_for()
    sb.run("mkdir -p d/e && echo x > d/e/f && echo y > .hidden")
    sb.reset()
    assert sb.run("ls -A").stdout == ""


# ---- backend-independent checks (no sandbox started) -------------------------------------------


def test_limits_validate_with_the_field_name():
    with pytest.raises(SandboxConfigError, match="Limits.memory_mb must be a positive int, got -1"):
        Limits(memory_mb=-1)
    with pytest.raises(SandboxConfigError, match="wall_time_s"):
        Limits(wall_time_s=0)
    with pytest.raises(SandboxConfigError, match="max_processes=2 is too small"):
        Limits(max_processes=2)
    assert Limits().replace(network=True).network is True


def test_unknown_backend_suggests_the_right_name():
    with pytest.raises(SandboxConfigError, match="Did you mean 'docker'"):
        make_sandbox("dokcer")
    with pytest.raises(SandboxConfigError, match="bad arguments for the 'local' backend"):
        make_sandbox("local", imagee="x")


def test_unstarted_sandbox_refuses_with_a_hint():
    sb = make_sandbox("local")
    with pytest.raises(SandboxStateError, match="call start"):
        sb.run("true")
    with pytest.raises(SandboxConfigError, match="empty string"):
        sb.run("   ")
    with pytest.raises(SandboxConfigError, match="timeout must be a positive"):
        sb.run("true", timeout=-1)
    with pytest.raises(SandboxConfigError, match="env var name"):
        sb.run("true", env={"A=B": "x"})
    with pytest.raises(SandboxConfigError, match="sessions support"):
        sb.session("ruby")


def test_exec_result_flags_and_description():
    r = ExecResult(exit_code=137, timed_out=True, wall_time_s=2.0)
    assert not r.ok and r.signal == 9 and "wall time limit" in r.describe()
    assert ExecResult(exit_code=0).ok and ExecResult(exit_code=0).signal is None
    assert ExecResult(exit_code=0, output_truncated=True).to_dict()["ok"] is False


def test_a_closed_session_refuses(make_sandbox_for):
    sb = make_sandbox_for()
    shell = sb.session("bash")
    shell.close()
    with pytest.raises(SessionError, match="closed"):
        shell.run("true")


def test_stop_from_another_thread_kills_a_running_command(make_sandbox_for):
    import threading
    import time

    from tests.helpers import host_processes_with

    sb = make_sandbox_for(wall_time_s=60)
    results = []
    marker = f"50.{time.time_ns() % 10**6}"  # a unique command line to find on the host
    runner = threading.Thread(target=lambda: results.append(sb.run(f"sleep {marker}")))
    runner.start()
    # stop once the command really runs (not after a guessed delay)
    deadline = time.monotonic() + 30
    while not host_processes_with(f"sleep {marker}") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert host_processes_with(f"sleep {marker}"), "the command never started"
    sb.stop()
    runner.join(timeout=30)
    assert not runner.is_alive(), "run() did not return after stop()"
    # killed, not slept out
    assert results and not results[0].ok and results[0].wall_time_s < 50, results


def test_back_to_back_runs_under_a_small_process_cap_all_run(make_sandbox_for):
    """Every run's processes are gone, reaped, when it returns: nothing of it still counts
    against the sandbox's process cap (bubblewrap's own init outlived each run as a zombie that
    only the host's PID 1 reaps, late here and never in a container without an init: with a cap
    of 8, half the runs failed "Can't fork for pid 1"), and no zombie of it is left anywhere."""
    sb = make_sandbox_for(max_processes=8)
    codes = [sb.run(["true"]).exit_code for _ in range(40)]
    assert codes == [0] * 40, codes
    if hasattr(sb, "uid") and sb.uid != os.getuid():  # a private uid: all of its processes
        zombies = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _zombie_of(p, sb.uid)]
        assert zombies == [], zombies


def _zombie_of(proc: Path, uid: int) -> bool:
    try:
        return proc.stat().st_uid == uid and (proc / "stat").read_text().rsplit(")", 1)[1][1] == "Z"
    except OSError:
        return False
