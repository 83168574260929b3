"""The fork server of warm local sandboxes (``sandboxes/_zygote.py``, ``sandboxes/_executor.py``).

Three kinds of property: nothing one run does reaches the next (each run is a fresh fork of a
zygote that never runs code of a run itself); a zygote that dies, runs out of memory or lies
costs a restart and a clearly reported run, never a hang or a crash of the host; and Python run
in the zygote's fork behaves as a freshly started ``python3 -I`` would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest

from sandboxes import Limits
from sandboxes._wire import in_process, zygote_source
from sandboxes.local import LocalSandbox
from tests.sandboxes.conftest import _local_skip_reason

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or bool(_local_skip_reason("bwrap")),
    reason="the warm executor needs root (cgroups) and bubblewrap",
)


@pytest.fixture
def sandbox():
    with LocalSandbox(limits=Limits(wall_time_s=20), warm_exec=True) as sb:
        yield sb


def py(sb: LocalSandbox, code: str, **kwargs):
    """Run ``code`` the way the zygote runs it in its own fork (``python3 -I -c``)."""
    argv = ["python3", "-I", "-c", textwrap.dedent(code)]
    assert sb._executor is not None and in_process(argv, sb._env({}), sb._executor.env)
    return sb.run(argv, **kwargs)


# ---- nothing of run N reaches run N+1 ---------------------------------------------------------
LEAVE_STATE = """
import builtins, json, os, random, signal, sys, threading, time
import xml.dom.minidom                      # a module nobody pre-imports
builtins.LEFT = json.LEFT = "run 1"         # globals, in builtins and in a pre-imported module
os.environ["LEFT"] = "run 1"
sys.path.append("/tmp/left"); sys.setrecursionlimit(77)
signal.signal(signal.SIGUSR1, lambda *a: None)
os.chdir("/tmp"); os.umask(0o077)
random.seed(1234)
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print(random.random())
"""
LOOK_FOR_STATE = """
import builtins, json, os, random, signal, sys
random.seed(1234)
print(json.dumps({
    "module": "xml.dom.minidom" in sys.modules,
    "builtins": hasattr(builtins, "LEFT"), "json": hasattr(json, "LEFT"),
    "environ": "LEFT" in os.environ, "path": "/tmp/left" in sys.path,
    "recursion": sys.getrecursionlimit(), "sigusr1": signal.getsignal(signal.SIGUSR1) is not None
        and signal.getsignal(signal.SIGUSR1) != signal.SIG_DFL,
    "cwd": os.getcwd(), "umask": os.umask(0o022), "threads": __import__("threading").active_count(),
    "random": random.random(),
}))
"""


def test_modules_globals_handlers_and_threads_of_a_run_are_not_in_the_next(sandbox):
    first = py(sandbox, LEAVE_STATE)
    assert first.ok, first
    seen = json.loads(py(sandbox, LOOK_FOR_STATE).stdout)
    assert seen == {
        "module": False,
        "builtins": False,
        "json": False,
        "environ": False,
        "path": False,
        "recursion": 1000,
        "sigusr1": False,
        "cwd": sandbox.workdir,
        "umask": 0o022,
        "threads": 1,
        "random": float(first.stdout),  # the same seed gives the same numbers: nothing shared
    }, seen


def test_unseeded_random_numbers_differ_between_runs(sandbox):
    """Each fork reseeds ``random`` (a zygote's state copied into every run would repeat)."""
    draws = {py(sandbox, "import random; print(random.random())").stdout for _ in range(3)}
    assert len(draws) == 3, draws


def test_a_background_process_of_a_run_is_gone_before_the_next(sandbox):
    leave = """
    import os, subprocess
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execvp("sleep", ["sleep", "300"])
        os._exit(0)
    subprocess.Popen(["sleep", "301"], start_new_session=True)
    print("left", flush=True)
    """
    assert py(sandbox, leave).stdout == "left\n"
    look = """
    import json, os
    others = [p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]
    print(json.dumps({p: open(f'/proc/{p}/cmdline').read().split(chr(0))[:3] for p in others}))
    """
    others = json.loads(py(sandbox, look).stdout)
    # nothing but the zygote (PID 1) and its spawner, both the zygote's program
    assert len(others) == 2 and "1" in others, others
    assert all(argv == ["python3", "-I", "-c"] for argv in others.values()), others
    assert sandbox._executor.verify() is None  # only the zygote (and its spare child) is left


def test_the_host_counts_every_process_of_a_sandbox_that_holds_hundreds():
    """One read of ``cgroup.procs`` gives about a page (~500 pids): the host must read on."""
    with LocalSandbox(limits=Limits(wall_time_s=20, max_processes=900), warm_exec=True) as sb:
        thread, _ = _run_in_thread(
            sb,
            """
            import os, time
            for _ in range(700):
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
            open("/tmp/ready", "w").close()
            time.sleep(60)
            """,
            timeout=15,
        )
        ready = Path(f"/proc/{sb._executor.host_pid}/root/tmp/ready")
        while not ready.exists() and thread.is_alive():
            os.sched_yield()
        counted = len(sb._executor._cgroup.pids())
        sb._executor._kill_others(set(sb._executor.keep))
        thread.join()
        assert counted >= 700 + 2, counted  # (and the zygote, its spawner, the run itself)
        assert sb.run(["echo", "still works"]).stdout == "still works\n"


def test_the_sandbox_runs_as_its_private_uid_and_the_caller_is_never_forked(monkeypatch):
    """bwrap runs as the leased uid with no groups; the launch is a vfork: ``Popen`` with
    ``user=`` forks the caller, whose page tables a trainer-sized process pays for per launch."""
    launches: list[dict] = []
    popen_init = subprocess.Popen.__init__

    def spy(self, *args, **kwargs):
        launches.append(kwargs)
        popen_init(self, *args, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", spy)
    with LocalSandbox(limits=Limits(wall_time_s=20), warm_exec=True) as sb:
        assert sb.run(["true"]).exit_code == 0
        fields = dict(
            line.split(":", 1)
            for line in Path(f"/proc/{sb._executor.host_pid}/status").read_text().splitlines()
        )
        assert fields["Uid"].split() == [str(sb.uid)] * 4 != [str(os.getuid())] * 4
        assert fields["Gid"].split() == [str(sb.uid)] * 4 and fields["Groups"].split() == []
    assert launches and all(kw.get("user") is None and kw.get("group") is None for kw in launches)


def test_files_a_run_leaves_do_not_reach_the_next_user(sandbox):
    leave = """
    import os
    for place in ("/sandbox", "/tmp", "/dev/shm"):
        os.makedirs(f"{place}/left/deep", exist_ok=True)
        open(f"{place}/left/deep/file", "w").write("x")
        os.chmod(f"{place}/left/deep", 0o000)  # made hard to delete
    os.mkfifo("/tmp/fifo")
    print("ok")
    """
    assert py(sandbox, leave).stdout == "ok\n"
    zygote = sandbox._executor.host_pid
    sandbox.reset()
    look = "import os; print([(p, os.listdir(p)) for p in ('/sandbox', '/tmp', '/dev/shm')])"
    assert py(sandbox, look).stdout == "[('/sandbox', []), ('/tmp', []), ('/dev/shm', [])]\n"
    assert sandbox._executor.host_pid == zygote, "cleaned in place, without a restart"


def test_what_a_run_sets_on_the_writable_directories_themselves_does_not_reach_the_next_user(
    sandbox,
):
    """Emptying a place is not enough: its own mode, extended attributes and times (a note for
    the next user, or a workdir made unwritable) are as the sandbox started them."""
    look = """
    import os
    for place in ("/sandbox", "/tmp"):
        st = os.stat(place)
        print(place, oct(st.st_mode), os.listxattr(place), st.st_mtime == 1234567890)
    open("/sandbox/mine", "w").write("written")
    """
    before = py(sandbox, look)
    assert before.ok, before
    leave = """
    import os
    for place in ("/sandbox", "/tmp"):
        os.setxattr(place, "user.note", b"from run 1")
        os.utime(place, (1234567890, 1234567890))
    os.chmod("/tmp", 0o000)
    os.chmod("/sandbox", 0o500)  # the next user could not write a file
    print("ok")
    """
    assert py(sandbox, leave).stdout == "ok\n"
    sandbox.reset()
    after = py(sandbox, look)
    assert after.ok and after.stdout == before.stdout, after


def test_sockets_a_run_leaves_in_the_kernel_do_not_reach_the_next_user(sandbox):
    """A closed TCP connection stays in the network namespace (TIME_WAIT) with no process
    holding it: the next user must not see it, nor find its port taken."""
    talk = """
    import socket
    server = socket.socket()
    server.bind(("127.0.0.1", 5555))
    server.listen()
    client = socket.create_connection(("127.0.0.1", 5555))
    peer, _ = server.accept()
    peer.close(); client.close(); server.close()
    print(open("/proc/net/tcp").read().count(chr(10)) > 1)
    """
    assert py(sandbox, talk).stdout == "True\n"  # its connection is still listed
    sandbox.reset()
    look = """
    import socket
    socket.socket().bind(("127.0.0.1", 5555))
    print(open("/proc/net/tcp").read().count(chr(10)))
    """
    after = py(sandbox, look)
    assert after.ok and after.stdout == "1\n", after  # the header alone


# ---- a zygote that dies, starves or lies ------------------------------------------------------
def _run_in_thread(sb: LocalSandbox, code: str, **kwargs) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(py(sb, code, **kwargs)))
    thread.start()
    return thread, out


def test_a_zygote_killed_mid_run_costs_a_restart(sandbox):
    executor = sandbox._executor
    zygote = executor.host_pid
    thread, out = _run_in_thread(
        sandbox, "import time; open('started', 'w').close(); time.sleep(60)", timeout=60
    )
    started = sandbox.dir / "scratch" / "started"
    deadline = time.monotonic() + 20  # the run is under way (no other signal comes out of it)
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(zygote, signal.SIGKILL)
    thread.join(30)
    assert not thread.is_alive(), "a run whose zygote died must return, not wait for its deadline"
    r = out[0]
    assert r.exit_code == 137 and not r.timed_out and "zygote" in r.stderr, r
    after = py(sandbox, "print('next run')")
    assert after.ok and after.stdout == "next run\n", after
    assert sandbox._executor.host_pid not in (0, zygote)
    assert sandbox._executor.verify() is None  # nothing of the run is left


def test_a_run_that_exhausts_the_sandbox_memory_costs_a_restart():
    limits = Limits(wall_time_s=30, memory_mb=64, disk_mb=256)
    with LocalSandbox(limits=limits, warm_exec=True) as sb:
        fill = """
        with open("/dev/shm/fill", "wb") as f:   # tmpfs pages count against the memory limit
            f.write(b"x" * (4 << 20))            # (each place is capped at memory_mb / 8)
        hog = b"x" * (200 << 20)                 # past memory_mb: the cgroup's OOM killer
        """
        r = py(sb, fill)
        assert not r.ok and (r.oom_killed or "zygote" in r.stderr), r
        after = py(sb, "import os; print(os.listdir('/dev/shm'))")
        assert after.ok and after.stdout == "[]\n", after


def test_signals_a_run_sends_the_zygote_do_not_stop_it(sandbox):
    zygote = sandbox._executor.host_pid
    attack = """
    import os, signal
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGQUIT,
                signal.SIGPIPE, signal.SIGALRM, signal.SIGCHLD, signal.SIGSEGV, signal.SIGKILL):
        os.kill(1, sig)
    print("sent")
    """
    assert py(sandbox, attack).stdout == "sent\n"
    after = py(sandbox, "print('next run')")
    assert after.ok and after.stdout == "next run\n" and "zygote" not in after.stderr, after
    assert sandbox._executor.host_pid == zygote, "a run stopped the zygote"


@pytest.mark.parametrize(
    "compromise", ["traced", "stopped", "limits lowered", "idle I/O", "short time slice"]
)
def test_reset_replaces_a_spawner_it_cannot_verify(sandbox, compromise):
    """What every command inherits comes from the spawner: a reset hands the next user a fresh
    one when it is traced, stopped, or runs with other limits, I/O priority or CPU time slice
    than it started with (a run of its uid can set them: ``ioprio_set``, ``sched_setattr``)."""
    import ctypes
    import platform
    import struct

    spawner = sandbox._executor.spawner_pid
    libc = ctypes.CDLL(None, use_errno=True)
    if compromise in ("idle I/O", "short time slice") and platform.machine() != "x86_64":
        pytest.skip("the test calls x86-64 system call numbers")
    if compromise == "idle I/O":  # ioprio_set(IOPRIO_WHO_PROCESS, spawner, IDLE class)
        assert libc.syscall(251, 1, spawner, 3 << 13) == 0, ctypes.get_errno()
    elif compromise == "short time slice":  # sched_setattr with a 0.1 ms runtime (its slice)
        attr = ctypes.create_string_buffer(struct.pack("IIQiIQQQ", 48, 0, 0, 0, 0, 10**5, 0, 0))
        assert libc.syscall(314, spawner, attr, 0) == 0, ctypes.get_errno()
    elif compromise == "traced":
        assert libc.ptrace(0x4206, spawner, 0, 0) == 0, ctypes.get_errno()  # PTRACE_SEIZE
    elif compromise == "stopped":
        os.kill(spawner, signal.SIGSTOP)
        while sandbox._executor.state(spawner) not in ("T", "t"):
            os.sched_yield()  # (the signal lands asynchronously)
    else:  # a run of its uid can (PID 2: forked by the zygote before anything else)
        lower = "import resource; resource.prlimit(2, resource.RLIMIT_NOFILE, (16, 16))"
        assert sandbox.run(["python3", "-c", lower]).ok
        assert sandbox.run(["sh", "-c", "ulimit -n"]).stdout == "16\n"  # the same user's runs
    sandbox.reset()
    assert sandbox._executor.spawner_pid not in (0, spawner)
    r = sandbox.run(["sh", "-c", "ulimit -n"], timeout=20)
    assert r.ok and r.stdout != "16\n", r


REPLIES = {
    # the zygote answers Python runs; its first answer is to the test's run
    "zygote": ('self.ctl.send(_REPLY.pack(b"X", _exit_code(status), run))', "self.ctl", 0),
    # the spawner starts commands; its first answer is to the executor's own first run
    "spawner": ('sock.send(_REPLY.pack(b"Y" if done else b"X", code, run))', "sock", 1),
}
HOSTILE = {
    "oversized": 'sock.send(b"X" + bytes(4096))',
    "status-out-of-range": 'sock.send(_REPLY.pack(b"X", 999, run))',
    "unknown-kind": 'sock.send(_REPLY.pack(b"Q", 0, run))',
    "another-run's-number": 'sock.send(_REPLY.pack(b"X", 0, run + 7))',
    "sends-a-file-descriptor": (
        'socket.send_fds(sock, [_REPLY.pack(b"X", 0, run)], [os.memfd_create("envhub-hostile")])'
    ),
    "answers-twice": (
        'sock.send(_REPLY.pack(b"X", code, run)); sock.send(_REPLY.pack(b"X", 0, run))'
    ),
    "never-answers": "pass",
}


def _hostile(process: str, behaviour: str) -> str:
    """The real zygote program, with ``process`` (``zygote`` or ``spawner``) honest for its
    first answers (those the executor's start needs), then doing ``behaviour``."""
    line, sock, honest = REPLIES[process]
    source = zygote_source()
    assert line in source, f"the {process}'s reply changed: update this test"
    code = "_exit_code(status)" if process == "zygote" else "code"
    helper = (
        "\n_SENT = []\n\n\ndef _reply(sock, code, run):\n    _SENT.append(code)\n"
        f"    if len(_SENT) <= {honest}:\n"
        '        sock.send(_REPLY.pack(b"X", code, run))\n        return\n'
        f"    {HOSTILE[behaviour]}\n\n\n"
    )
    source = source.replace(line, f"_reply({sock}, {code}, run)")
    return source.replace('if __name__ == "__main__":', helper + 'if __name__ == "__main__":')


def _host_fds() -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("behaviour", list(HOSTILE))
@pytest.mark.parametrize("process", list(REPLIES))
def test_a_zygote_that_lies_costs_a_restart_and_never_hangs_the_host(
    process, behaviour, monkeypatch
):
    hostile = _hostile(process, behaviour)
    monkeypatch.setattr("sandboxes._executor.zygote_source", lambda: hostile)
    with LocalSandbox(limits=Limits(wall_time_s=1), warm_exec=True) as sb:
        zygote = sb._executor.host_pid
        r = py(sb, "print('hi')") if process == "zygote" else sb.run(["echo", "hi"])
        assert not any("envhub-hostile" in fd for fd in _host_fds()), "the host took its fd"
        monkeypatch.undo()  # the restart brings up an honest one

        def again(word: str):
            return py(sb, f"print('{word}')") if process == "zygote" else sb.run(["echo", word])

        lost = "zygote" in r.stderr and r.exit_code == 137
        if behaviour == "answers-twice":  # a true answer, then one nobody asked for, which
            assert r.ok and r.stdout == "hi\n", r  # never passes for the next run's answer:
            after = again("next")  # it is found before that run starts, or as it runs
            assert (after.ok and after.stdout == "next\n") or "zygote" in after.stderr, after
        elif behaviour == "never-answers":  # the host's deadline decides, not the zygote
            assert r.timed_out and r.exit_code == 137 and lost, r
        else:
            assert lost, r
        after = again("after")
        assert after.ok and after.stdout == "after\n", after
        assert sb._executor.host_pid != zygote, "a zygote or spawner that lied was kept"


def test_a_run_that_stops_or_kills_the_spawner_costs_a_restart(sandbox):
    """The spawner is not PID 1: a run of the same uid can signal it. Its state is checked before
    each command: a stopped or dead one is replaced, and the command still runs."""
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        spawner = sandbox._executor.spawner_pid
        os.kill(spawner, sig)  # as a run of the sandbox's uid could
        while sandbox._executor.state(spawner) not in ("T", "t", "Z", "X"):
            os.sched_yield()  # (the signal lands asynchronously)
        r = sandbox.run(["echo", "still works"], timeout=20)
        assert r.ok and r.stdout == "still works\n" and not r.timed_out, r
        assert sandbox._executor.spawner_pid not in (0, spawner)


TAKE_THE_SPAWNERS_PID = """
import os, signal
os.kill(2, signal.SIGKILL)  # the spawner: PID 2 here, and of the run's uid
while os.path.exists("/proc/2"):
    os.sched_yield()  # (reaped by the zygote)
open("/sandbox/ready", "w").close()
while not os.path.exists("/sandbox/go"):
    os.sched_yield()
if os.fork() == 0:  # (the host has just made the spawner's pid the next one)
    os.setsid()
    for fd in (0, 1, 2):
        os.close(fd)
    with open("/proc/self/comm", "w") as comm:
        comm.write("impostor")
    open("/sandbox/forked", "w").close()
    signal.pause()  # waits for the next run
while not os.path.exists("/sandbox/seen"):
    os.sched_yield()
"""

SEES_THE_IMPOSTOR = """
import os
names = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        names.append(open(f"/proc/{pid}/comm").read().strip())
    except OSError:
        pass
print("impostor" in names)
"""


@pytest.mark.parametrize("then", ["reset", "run"])
def test_a_process_that_takes_the_killed_spawners_pid_is_not_spared(sandbox, then):
    """Spared processes are known by pid and start time: a run that kills the spawner and gets
    its pid for a process of its own (pids wrap around: the host's ``ns_last_pid`` does it at
    once here) does not pass it off as the spawner. Neither the next user (after a reset) nor
    this user's next run meets it, and the sandbox goes on with a new spawner."""
    executor = sandbox._executor
    spawner, scratch = executor.spawner_pid, sandbox.dir / "scratch"
    thread, out = _run_in_thread(sandbox, TAKE_THE_SPAWNERS_PID)
    while not (scratch / "ready").exists():
        os.sched_yield()
    Path("/proc/sys/kernel/ns_last_pid").write_text(str(spawner - 1))
    (scratch / "go").touch()
    while not (scratch / "forked").exists() and thread.is_alive():
        os.sched_yield()
    try:
        took = Path(f"/proc/{spawner}/comm").read_text().strip() == "impostor"
    except OSError:
        took = False
    (scratch / "seen").touch()
    thread.join()
    assert out[0].ok, out[0]
    if not took:
        pytest.xfail("another process of this host took the pid first (nothing was shown)")
    if then == "reset":
        sandbox.reset()
    after = py(sandbox, SEES_THE_IMPOSTOR)
    assert after.ok and after.stdout == "False\n", after
    assert spawner not in sandbox._executor._cgroup.pids()
    assert sandbox.run(["echo", "still works"]).stdout == "still works\n"


def test_a_signal_still_on_its_way_to_the_spawner_costs_a_restart_too(sandbox):
    """A run's ``kill()`` returns before its target has died: the spawner must be scheduled to
    die. A command sent in that window would be lost (CI saw exactly that under load: the run
    after the one that killed every process it could see came back as exit 137). Here the
    window is held open: the spawner shares this test's CPU at idle priority, so it cannot run
    (and die) while this thread sends the next command."""
    for attempt in range(5):
        assert sandbox.run(["true"]).ok  # a (new) spawner is up
        spawner = sandbox._executor.spawner_pid
        assert spawner > 1, spawner
        mine = os.sched_getaffinity(0)
        cpu = {min(mine)}
        os.sched_setaffinity(spawner, cpu)
        os.sched_setscheduler(spawner, os.SCHED_IDLE, os.sched_param(0))
        os.sched_setaffinity(0, cpu)
        try:
            os.kill(spawner, signal.SIGKILL)  # as a run of the sandbox's uid could
            r = sandbox.run(["echo", "still works"], timeout=20)
        finally:
            os.sched_setaffinity(0, mine)
        assert r.ok and r.stdout == "still works\n" and not r.timed_out, (attempt, r)
        assert sandbox._executor.spawner_pid not in (0, spawner)


# ---- Python in the fork behaves as python3 -I --------------------------------------------------
PROGRAMS = {
    "output-and-exit-code": "import sys; print('out'); sys.stderr.write('err\\n'); sys.exit(3)",
    "traceback": "def f():\n    raise ValueError('boom')\nf()",
    "syntax-error": "def f(:\n    pass",
    "exit-with-message": "raise SystemExit('bye')",
    "exit-code-wraps": "import sys; sys.exit(256 + 5)",
    "keyboard-interrupt": "raise KeyboardInterrupt",
    "stdin-and-argv": "import sys; print(sys.argv, sys.stdin.read().upper(), __name__)",
    "unflushed-at-exit": "import sys; sys.stdout.write('no newline')",
    "atexit-and-threads": (
        "import atexit, threading, time\natexit.register(print, 'atexit ran')\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))).start()\n"
        "print('main done')"
    ),
    "finalizer-of-a-global": (
        "class T:\n    def __del__(self):\n        print('finalized')\nt = T()\nprint('end')"
    ),
    "unclosed-file": "f = open('unclosed.txt', 'w'); f.write('flushed at exit')",
    "encodings-and-signals": (
        "import signal, sys\nprint('héllo ☃', sys.stdout.encoding, sys.stdout.errors, "
        "sys.stderr.errors, sys.flags.isolated, sys.path == sorted(sys.path, key=sys.path.index))\n"
        "print([signal.getsignal(s) for s in (signal.SIGINT, signal.SIGPIPE, signal.SIGTERM)])"
    ),
    "cpu-limit": "while True: pass",
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_python_in_the_fork_behaves_as_a_fresh_interpreter(name):
    limits = Limits(wall_time_s=20, cpu_time_s=1)
    with LocalSandbox(limits=limits, warm_exec=True) as sb:
        code = PROGRAMS[name]
        sb.write_file("prog.py", code)
        forms = (
            (["-c", code, "arg"],)
            if name == "cpu-limit"
            else (["-c", code, "arg"], ["prog.py", "arg"])
        )
        for argv in forms:
            forked = py_argv(sb, argv, stdin="piped")
            if name == "unclosed-file":
                assert sb.read_file("unclosed.txt") == "flushed at exit"
                sb.run(["rm", "unclosed.txt"])
            fresh = sb.run(["sh", "-c", 'exec python3 -I "$@"', "sh", *argv], stdin="piped")
            assert (forked.exit_code, forked.stdout, forked.stderr) == (
                fresh.exit_code,
                fresh.stdout,
                fresh.stderr,
            ), (argv[0], forked, fresh)


def py_argv(sb: LocalSandbox, argv: list[str], **kwargs):
    full = ["python3", "-I", *argv]
    assert in_process(full, sb._env({}), sb._executor.env)
    return sb.run(full, **kwargs)


def test_what_runs_in_the_fork_and_what_is_execed():
    env = {"PATH": "/usr/bin", "LANG": "C.UTF-8"}
    assert in_process(["python3", "-I", "-c", "pass"], env, env)
    assert in_process(["python3", "-I", "x.py", "-v"], {**env, "HOME": "/x", "PYTHONX": "1"}, env)
    for argv in (["python3", "-c", "pass"], ["python3", "-I"], ["python3", "-I", "-c"],
                 ["python3", "-I", "-u", "x.py"], ["python3", "-I", ""], ["python", "-I", "x.py"],
                 ["/usr/bin/python3", "-I", "x.py"], ["python3", "-I", "-"]):  # fmt: skip
        assert not in_process(argv, env, env), argv
    for changed in ({"PATH": "/opt/bin"}, {"LANG": "C"}, {"LC_ALL": "C"}, {"TZ": "UTC"}):
        assert not in_process(["python3", "-I", "x.py"], {**env, **changed}, env), changed


def test_the_zygote_source_is_the_module_shipped_with_the_package():
    assert zygote_source() == (Path(__file__).parents[2] / "sandboxes" / "_zygote.py").read_text()
