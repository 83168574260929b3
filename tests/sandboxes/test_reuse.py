"""What one user of a sandbox leaves behind never reaches the next one.

A pool hands one sandbox to many users in turn, calling ``reset()`` between them. Each test
here is one class of leftover: user 1 runs hostile code that leaves something behind, the
sandbox is reset, and user 2 must find nothing of it. Where a leftover pins a resource, the
test also checks that it cannot grow past the cap user 2 is promised. The probes are small
Python programs run inside the sandbox (``ctypes`` for the raw syscalls), so every backend is
attacked the same way. Sections follow the classes of issue 13: 2 kernel objects that are not
files, 3 resources that bypass the caps, 4 robustness.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import time

import pytest

from sandboxes import Sandbox, SandboxFileError
from tests.helpers import host_command_lines

KEY_SYSCALLS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}
"""(add_key, request_key, keyctl) syscall numbers by machine."""

_PRELUDE = """\
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
def err(rc):
    return "ok" if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
"""

IPC_PROBE = (
    _PRELUDE
    + """\
mode, key = sys.argv[1], int(sys.argv[2])
name = f"/envhub-{key}".encode()
flags = 0o1666 if mode == "leave" else 0  # IPC_CREAT | 0666
libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
mq_flags = os.O_CREAT | os.O_RDWR if mode == "leave" else os.O_RDONLY
found = {
    "msg": err(libc.msgget(key, flags)),
    "sem": err(libc.semget(key + 1, 1, flags)),
    "shm": err(libc.shmget(key + 2, ctypes.c_size_t(1 << 20), flags)),
    "mq": err(libc.mq_open(name, mq_flags, 0o666, None)),
}
listed = []
for path in ("/proc/sysvipc/msg", "/proc/sysvipc/sem", "/proc/sysvipc/shm"):
    try:
        listed += [line.split()[0] for line in open(path).read().splitlines()[1:]]
    except OSError:
        pass
try:
    listed += os.listdir("/dev/mqueue")
except OSError:
    pass
print(json.dumps({"found": found, "listed": listed}))
"""
)

FILL_PROBE = (
    _PRELUDE
    + """\
cap = int(sys.argv[1]) << 20
goal = 3 * cap
places = {os.getcwd(), "/tmp", "/dev/shm", "/var/tmp", "/run", "/run/shm", "/run/lock"}
for line in open("/proc/self/mounts"):
    _, where, fstype, options = line.split()[:4]
    if fstype in ("tmpfs", "ramfs", "devtmpfs") and "rw" in options.split(","):
        places.add(where.replace("\\\\040", " "))
chunk = b"x" * (1 << 20)
report = {}
for place in sorted(places):
    if not os.path.isdir(place) or not os.access(place, os.W_OK | os.X_OK):
        continue
    written, names = 0, []
    try:
        while written < goal:
            names.append(os.path.join(place, f"envhub-fill-{len(names)}"))
            fd = os.open(names[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                for _ in range(4):  # 4 MiB files: RLIMIT_FSIZE is not what stops this
                    written += os.write(fd, chunk)
            finally:
                os.close(fd)
    except OSError as e:
        report[place] = [written, errno.errorcode.get(e.errno, str(e.errno))]
    else:
        report[place] = [written, "no error"]
    for name in names:
        try:
            os.unlink(name)
        except OSError:
            pass
print(json.dumps(report))
"""
)

MQUEUE_FILL_PROBE = (
    _PRELUDE
    + """\
class Attr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long),
                ("curmsgs", ctypes.c_long), ("pad", ctypes.c_long * 4)]
libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(Attr)]
libc.mq_send.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint]
goal = 3 * (int(sys.argv[1]) << 20)
sent, queues, why = 0, [], "no error"
payload = b"m" * 8192
new_queue = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NONBLOCK
while sent < goal and why == "no error":
    name = f"/envhub-fill-{os.getpid()}-{len(queues)}".encode()
    attr = Attr(0, 10, len(payload), 0)
    q = libc.mq_open(name, new_queue, 0o600, ctypes.byref(attr))
    if q < 0:
        attr = Attr(0, 1, 1024, 0)  # default limits refused: the smallest useful queue
        q = libc.mq_open(name, new_queue, 0o600, ctypes.byref(attr))
    if q < 0:
        why = err(q)
        break
    queues.append(name)
    while sent < goal:
        if libc.mq_send(q, payload, attr.msgsize, 0) < 0:
            break
        sent += attr.msgsize
for name in queues:
    libc.mq_unlink(name)
print(json.dumps([sent, why, len(queues)]))
"""
)

SYSV_SHM_FILL_PROBE = (
    _PRELUDE
    + """\
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
goal, size = 3 * (int(sys.argv[1]) << 20), 4 << 20
held, ids, why = 0, [], "no error"
while held < goal:
    shm = libc.shmget(0, ctypes.c_size_t(size), 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    if shm < 0:
        why = err(shm)
        break
    ids.append(shm)
    addr = libc.shmat(shm, None, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        why = err(-1)
        break
    ctypes.memset(addr, 1, size)  # touch every page: this is what pins memory
    held += size
for shm in ids:
    libc.shmctl(shm, 0, None)  # IPC_RMID
print(json.dumps([held, why]))
"""
)

KEY_PROBE = (
    _PRELUDE
    + """\
import platform
NRS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}
ADD_KEY, REQUEST_KEY, KEYCTL = NRS[platform.machine()]
libc.syscall.restype = ctypes.c_long
def call(*args):
    return libc.syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
mode, desc = sys.argv[1], sys.argv[2].encode()
rings = {"session": -3, "user": -4, "user-session": -5}
out = {}
if mode == "leave":
    payload = sys.argv[3].encode()
    for ring, ring_id in rings.items():
        out[ring] = err(call(ADD_KEY, b"user", desc, payload, len(payload), ring_id))
else:
    ids = [call(REQUEST_KEY, b"user", desc, None, 0)]
    out["request_key"] = err(ids[0])
    for ring, ring_id in rings.items():
        ids.append(call(KEYCTL, 10, ring_id, b"user", desc, 0))  # KEYCTL_SEARCH
        out[ring] = err(ids[-1])
    for key_id in ids:
        buf = ctypes.create_string_buffer(4096)
        n = call(KEYCTL, 11, key_id, buf, 4096) if key_id > 0 else -1  # KEYCTL_READ
        if n > 0:
            out.setdefault("read", []).append(buf.raw[:n].decode(errors="replace"))
    # a leaked key would stay in the uid's keyring for good: KEYCTL_INVALIDATE it
    for key_id in ids:
        if key_id > 0:
            call(KEYCTL, 21, key_id)
    try:
        out["proc_keys"] = open("/proc/keys").read()
    except OSError as e:
        out["proc_keys"] = errno.errorcode.get(e.errno, str(e.errno))
print(json.dumps(out))
"""
)

KEY_DENIAL_PROBE = (
    _PRELUDE
    + """\
import platform
NRS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}
ADD_KEY, REQUEST_KEY, KEYCTL = NRS[platform.machine()]
libc.syscall.restype = ctypes.c_long
def call(*args):
    return libc.syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
print(json.dumps({
    "add_key": err(call(ADD_KEY, b"user", b"envhub-denial", b"x", 1, -4)),
    "request_key": err(call(REQUEST_KEY, b"user", b"envhub-denial", None, 0)),
    "keyctl": err(call(KEYCTL, 0, -3, 0)),  # KEYCTL_GET_KEYRING_ID of the session keyring
    "join_session": err(call(KEYCTL, 1, None)),  # KEYCTL_JOIN_SESSION_KEYRING (anonymous)
}))
"""
)

LEAVE_A_PROCESS = """\
import os, signal, sys
marker, kill_parent = sys.argv[1], sys.argv[2] == "yes"
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        fd = os.open("/dev/null", os.O_RDWR)
        for i in (0, 1, 2):
            os.dup2(fd, i)
        os.execvp("sleep", ["sleep", marker])
    os._exit(0)
os.wait()
print("left", flush=True)
if kill_parent and os.getppid() > 1:  # the wrapper or executor that would clean up after us
    os.kill(os.getppid(), signal.SIGKILL)
"""

COUNT_PROCESSES = """\
import os, sys
found = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\\0")[:-1]
        except OSError:
            continue
        if argv == ["sleep", sys.argv[1]]:
            found.append(pid)
print(len(found), found)
"""


def probe(sb: Sandbox, source: str, *args: object, timeout: float = 30) -> object:
    r = sb.run(["python3", "-c", source, *map(str, args)], timeout=timeout)
    assert r.exit_code == 0 and not r.timed_out, r
    return json.loads(r.stdout)


def next_user_after_reset(sb: Sandbox) -> Sandbox:
    """What ``SandboxPool`` does between two users."""
    sb.reset()
    return sb


def still_works(sb: Sandbox) -> None:
    r = sb.run(["python3", "-c", "print('alive')"], timeout=20)
    assert r.ok and r.stdout == "alive\n", r


def unique() -> int:
    return (time.time_ns() // 1000 + os.getpid()) % 1_000_000_000 + 1_000_000


def host_sleeps(duration: str) -> list[int]:
    """Pids of ``sleep <duration>`` on the host (where local sandboxes and the test engine run)."""
    return [pid for pid, argv in host_command_lines().items() if argv == ["sleep", duration]]


# ---- 2. kernel objects that are not files ----------------------------------------------------
def test_ipc_objects_do_not_reach_the_next_user(make_sandbox_for):
    sb = make_sandbox_for()
    key = unique()
    left = probe(sb, IPC_PROBE, "leave", key)
    assert any(v == "ok" for v in left["found"].values()), (
        f"user 1 could create no IPC object at all: {left}"
    )
    seen = probe(next_user_after_reset(sb), IPC_PROBE, "look", key)
    assert not any(v == "ok" for v in seen["found"].values()), (
        f"user 2 opened user 1's IPC objects: {seen}"
    )
    mine = {str(key), str(key + 1), str(key + 2), f"envhub-{key}"}
    assert not mine & set(seen["listed"]), f"user 2 lists user 1's IPC objects: {seen['listed']}"
    still_works(sb)


def test_files_in_dev_shm_and_tmp_do_not_reach_the_next_user(make_sandbox_for):
    sb = make_sandbox_for()
    marker = f"envhub-left-{unique()}"
    places = ("/dev/shm", "/tmp", "/var/tmp", "/run", "/run/lock", ".")
    leave = "".join(
        f"mkdir -p {p}/{marker}.d 2>/dev/null; echo x > {p}/{marker} 2>/dev/null; " for p in places
    )
    r = sb.run(
        leave + "ls -d " + " ".join(f"{p}/{marker}" for p in places) + " 2>/dev/null; true",
        timeout=20,
    )
    assert r.exit_code == 0 and f"./{marker}" in r.stdout, r
    left = r.stdout.split()
    r = next_user_after_reset(sb).run(
        "ls -d " + " ".join(f"{p}/{marker}*" for p in places) + " 2>/dev/null; true", timeout=20
    )
    assert r.exit_code == 0 and r.stdout == "", (
        f"user 1 left {left}; user 2 still sees {r.stdout.split()}"
    )
    still_works(sb)


def _key_syscalls_or_skip() -> None:
    if platform.machine() not in KEY_SYSCALLS:
        pytest.skip(f"keyring syscall numbers unknown for {platform.machine()}")


LEAVE_ON_THE_PLACES = """\
import os, struct
# a default ACL user::---, group::---, other::--- (header version 2, then three entries)
acl = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", t, 0, 0xFFFFFFFF) for t in (1, 4, 0x20))
for place in ("/sandbox", "/tmp"):
    for name, value in (("user.note", b"from user 1"), ("system.posix_acl_default", acl)):
        try:
            os.setxattr(place, name, value)
        except OSError:
            pass
    try:
        os.chmod(place, 0o700)
    except OSError:
        pass
print("ok")
"""
LOOK_AT_THE_PLACES = """\
import os
for place in ("/sandbox", "/tmp"):
    st = os.stat(place)
    print(place, oct(st.st_mode), sorted(os.listxattr(place)))
    with open(f"{place}/mine", "w") as f:
        f.write("written")
    print(oct(os.stat(f"{place}/mine").st_mode), open(f"{place}/mine").read())
    os.unlink(f"{place}/mine")
"""


def test_what_a_run_sets_on_scratch_itself_does_not_reach_the_next_user(make_sandbox_for):
    """Emptying scratch is not enough: its own mode, extended attributes and default ACL (a
    note for the next user; files of the next user created mode 000, or a scratch it cannot
    enter) are as the sandbox started them after ``reset()``, and the next user's files work."""
    sb = make_sandbox_for()
    before = sb.run(["python3", "-c", LOOK_AT_THE_PLACES], timeout=20)
    assert before.ok, before
    assert sb.run(["python3", "-c", LEAVE_ON_THE_PLACES], timeout=20).stdout == "ok\n"
    sb.reset()
    after = sb.run(["python3", "-c", LOOK_AT_THE_PLACES], timeout=20)
    assert after.ok and after.stdout == before.stdout, after
    sb.write_file("sol.py", "print('user 2 ok')")
    r = sb.run(["python3", "sol.py"], timeout=20)
    assert r.ok and r.stdout == "user 2 ok\n", r
    assert sb.read_file("sol.py") == "print('user 2 ok')"


@pytest.mark.usefixtures("private_session_keyring")
def test_keys_do_not_reach_the_next_user_or_a_later_sandbox(make_sandbox_for):
    sb = make_sandbox_for()
    desc, payload = f"envhub-key-{unique()}", f"secret-{unique()}"
    probe(sb, KEY_PROBE, "leave", desc, payload)
    seen = probe(next_user_after_reset(sb), KEY_PROBE, "look", desc)
    assert payload not in json.dumps(seen) and desc not in seen["proc_keys"], (
        f"user 2 found user 1's key: {seen}"
    )
    sb.stop()  # the user keyring belongs to the uid, which a later sandbox may get again
    later = make_sandbox_for()
    seen = probe(later, KEY_PROBE, "look", desc)
    assert payload not in json.dumps(seen) and desc not in seen["proc_keys"], (
        f"a later sandbox found it: {seen}"
    )
    still_works(later)


def test_keyring_syscalls_are_denied(make_sandbox_for):
    _key_syscalls_or_skip()
    sb = make_sandbox_for()
    seen = probe(sb, KEY_DENIAL_PROBE)
    assert set(seen.values()) <= {"EPERM", "ENOSYS"}, (
        f"keyring syscalls must be refused by seccomp: {seen}"
    )
    still_works(sb)


# ---- 3. resources that bypass the caps -------------------------------------------------------
def test_every_writable_tmpfs_is_capped_at_disk_mb(make_sandbox_for):
    sb = make_sandbox_for(disk_mb=16, memory_mb=512, max_file_size_mb=64)
    report = probe(sb, FILL_PROBE, 16, timeout=60)
    assert report, "the probe found no writable place at all (not even scratch)"
    over = {place: got for place, got in report.items() if got[0] > 16 << 20}
    assert not over, f"writes past disk_mb=16 MiB succeeded in {over} (all: {report})"
    still_works(sb)


def test_filling_every_writable_place_leaves_memory_for_the_next_run(make_sandbox_for):
    """Writable tmpfs is memory: were its caps together above ``memory_mb`` (three of the
    default ``disk_mb=256`` against ``memory_mb=512``), filling them would be a memory bomb
    that OOM-kills every later run until ``reset()``. A disk fill must stop at its cap."""
    sb = make_sandbox_for(memory_mb=128, max_file_size_mb=1024)  # default disk_mb: 256
    fill = "for d in . /tmp /dev/shm; do head -c 300M /dev/zero > $d/fill 2>/dev/null; done"
    r = sb.run(fill + "; echo filled", timeout=60)
    assert r.stdout == "filled\n" and not r.oom_killed, r
    r = sb.run(["python3", "-c", "b = bytearray(32 << 20); print('ok')"], timeout=20)
    assert r.ok and r.stdout == "ok\n" and not r.oom_killed, r


def test_posix_message_queues_hold_at_most_disk_mb(make_sandbox_for):
    sb = make_sandbox_for(disk_mb=1)
    sent, why, queues = probe(sb, MQUEUE_FILL_PROBE, 1, timeout=60)
    assert sent <= 1 << 20, (
        f"{sent} bytes queued in {queues} POSIX message queues with disk_mb=1 (stopped: {why})"
    )
    still_works(sb)


def test_sysv_shared_memory_is_capped_at_disk_mb(make_sandbox_for):
    sb = make_sandbox_for(disk_mb=16, memory_mb=512)
    held, why = probe(sb, SYSV_SHM_FILL_PROBE, 16, timeout=60)
    assert held <= 16 << 20, (
        f"{held >> 20} MiB of SysV shared memory held with disk_mb=16 (stopped: {why})"
    )
    still_works(sb)


@pytest.mark.parametrize(
    "kill_parent", ["no", "yes"], ids=["daemon", "daemon-that-kills-its-parent"]
)
def test_a_process_left_behind_is_dead_when_the_run_returns(make_sandbox_for, kill_parent):
    sb = make_sandbox_for()
    marker = f"{unique()}.{os.getpid() % 1000}"  # a `sleep` duration nobody else uses
    r = sb.run(["python3", "-c", LEAVE_A_PROCESS, marker, kill_parent], timeout=20)
    assert "left" in r.stdout and not r.timed_out, r
    assert not host_sleeps(marker), "a process of the run outlived it"
    r = sb.run(["python3", "-c", COUNT_PROCESSES, marker], timeout=20)
    assert r.ok and r.stdout.startswith("0 "), f"the next run still sees it: {r}"
    r = next_user_after_reset(sb).run(["python3", "-c", COUNT_PROCESSES, marker], timeout=20)
    assert r.ok and r.stdout.startswith("0 "), f"the next user still sees it: {r}"
    still_works(sb)


# ---- 4. robustness -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path",
    [
        "n" * 256,
        "é" * 128,
        "/".join(["d" * 200] * 25),
        "sub/" + "n" * 300,
    ],
    ids=["name-256-bytes", "name-256-utf8-bytes", "path-5000-bytes", "nested-name-300"],
)
def test_an_over_long_path_raises_sandbox_file_error(make_sandbox_for, path):
    sb = make_sandbox_for()
    with pytest.raises(SandboxFileError):
        sb.write_file(path, "x")
    with pytest.raises(SandboxFileError):
        sb.read_file(path)
    sb.write_file("n" * 255, "longest name")  # the longest name Linux allows still works
    assert sb.read_file("n" * 255) == "longest name"
    still_works(sb)


# ---- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def private_session_keyring() -> None:
    """Join a fresh anonymous session keyring in this test process, so that a key a sandbox
    leaks into the keyring it inherited lands there, not in a login keyring others share."""
    if platform.machine() not in KEY_SYSCALLS:
        pytest.skip(f"keyring syscall numbers unknown for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    keyctl = KEY_SYSCALLS[platform.machine()][2]
    # KEYCTL_JOIN_SESSION_KEYRING
    if libc.syscall(ctypes.c_long(keyctl), ctypes.c_long(1), None) < 0:
        code = errno.errorcode.get(ctypes.get_errno())
        pytest.skip(f"this host has no keyrings: keyctl failed with {code}")
