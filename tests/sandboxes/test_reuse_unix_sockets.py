"""UNIX sockets one user of a warm local sandbox leaves in the kernel do not reach the next.

A socket whose own fd is in flight inside itself (SCM_RIGHTS) outlives every process of the
run: only the kernel's unix garbage collector frees it, some time later. Until then it keeps
its abstract name bound (a channel to the next user, and a name the next user cannot bind)
and whatever else is in flight with it (a memfd's memory, charged to the sandbox). So the
reset between users must not hand over the network namespace that lists it.
"""

from __future__ import annotations

import contextlib
import os
import textwrap
import time

import pytest

from sandboxes import Limits, _host
from sandboxes.local import LocalSandbox
from tests.sandboxes.conftest import _local_skip_reason

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or bool(_local_skip_reason("bwrap")),
    reason="the warm executor needs root (cgroups) and bubblewrap",
)

LEAVE = """
import array, os, socket

def in_flight(sock, *fds, to=None):
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [sock.fileno(), *fds]))]
    sock.sendmsg([b"x"], rights, 0, *([to] if to else []))

stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
stream.bind("\\0userA-stream"); stream.listen()
client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); client.connect("\\0userA-stream")
peer, _ = stream.accept()
in_flight(client, stream.fileno(), peer.fileno())
in_flight(peer, stream.fileno(), client.fileno())
dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
dgram.bind("\\0userA-dgram")
in_flight(dgram, to="\\0userA-dgram")
pinned = os.memfd_create("pinned")
os.write(pinned, b"x" * 4096)
left, right = socket.socketpair()  # no name at all: memory in flight
in_flight(left, right.fileno(), pinned)
in_flight(right, left.fileno())
sockets = (stream, client, peer, dgram, left, right)
print(" ".join(str(os.fstat(s.fileno()).st_ino) for s in sockets))
"""
LOOK = """
import json, socket, sys
listed = open("/proc/net/unix").read().splitlines()[1:]  # first: before any socket of ours
inodes = {line.split()[6] for line in listed}
bound = []
for name, kind in (("userA-stream", socket.SOCK_STREAM), ("userA-dgram", socket.SOCK_DGRAM)):
    with socket.socket(socket.AF_UNIX, kind) as probe:
        try:
            probe.bind("\\0" + name)
        except OSError:
            bound.append(name)
left = sorted(inodes & set(sys.argv[1:]))
print(json.dumps({"listed": left, "names": [l for l in listed if "@userA" in l], "bound": bound}))
"""


def py(sb: LocalSandbox, code: str, *args: str):
    return sb.run(["python3", "-I", "-c", textwrap.dedent(code), *args])


def test_unix_sockets_held_only_by_the_kernel_do_not_reach_the_next_user():
    with LocalSandbox(limits=Limits(wall_time_s=20), warm_exec=True) as sandbox:
        left = py(sandbox, LEAVE)
        assert left.ok, left
        sandbox.reset()
        look = py(sandbox, LOOK, *left.stdout.split())
        assert look.ok, look
        assert look.stdout.strip() == '{"listed": [], "names": [], "bound": []}', look.stdout


def test_a_reset_after_ordinary_socket_use_keeps_the_zygote():
    """The check costs a restart only when something is left: sockets a run closed are gone,
    and the zygote's own (the spare child's socketpair) are not the run's."""
    use = """
    import socket
    a, b = socket.socketpair(); a.send(b"x"); b.recv(1); a.close(); b.close()
    s = socket.socket(socket.AF_UNIX); s.bind("\\0closed-before-the-end"); s.close()
    print("ok")
    """
    with LocalSandbox(limits=Limits(wall_time_s=20), warm_exec=True) as sandbox:
        assert py(sandbox, use).stdout == "ok\n"
        assert sandbox._executor is not None
        zygote = sandbox._executor.host_pid
        sandbox.reset()
        assert py(sandbox, "print('next')").stdout == "next\n"
        assert sandbox._executor.host_pid == zygote, "a clean run must not cost a restart"


def _sockets(pid: int) -> set[str]:
    names = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            names.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return {name for name in names if name.startswith("socket:")}


def test_a_spare_forked_while_the_reset_looks_is_not_a_leftover(monkeypatch):
    """The zygote forks its spare when it likes (after a Python run, while the reset between
    users is under way): a socketpair, one end in a child no earlier look at the processes
    knew. The reset must not take that end for a socket only the kernel holds (CI saw the
    needless restart). Here the spare is forked right after the reset reads the processes."""
    with LocalSandbox(limits=Limits(wall_time_s=20), warm_exec=True) as sandbox:
        assert sandbox.run(["true"]).exit_code == 0  # (a command: no spare is asked for)
        executor = sandbox._executor
        assert executor is not None
        zygote, pids = executor.host_pid, executor._cgroup.pids
        state = {"fork": "no"}

        def spare_right_after(*args):  # the next reading of the processes forks the spare
            state["fork"] = "next reading"
            return inet_sockets(*args)

        def pids_then_fork():
            seen = pids()
            if state["fork"] != "next reading":
                return seen
            state["fork"] = "forked"
            executor._prefork()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # until the spare holds an end the zygote does not
                spare = pids() - seen
                if spare and _sockets(next(iter(spare))) - _sockets(zygote):
                    return seen
            raise AssertionError("the zygote forked no spare")

        inet_sockets = _host.inet_sockets
        monkeypatch.setattr(_host, "inet_sockets", spare_right_after)
        monkeypatch.setattr(executor._cgroup, "pids", pids_then_fork)
        sandbox.reset()
        assert state["fork"] == "forked", "the reset never looked for sockets"
        assert py(sandbox, "print('next')").stdout == "next\n"
        assert executor.host_pid == zygote and sandbox._executor is executor, "a restart"
