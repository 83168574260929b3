"""Command lines that put one process into a fresh set of Linux namespaces.

Two ways, same result (what the sandboxed program sees):

``/`` read-only with only ``/usr`` (plus the ``/bin``, ``/lib*`` links), a handful of public
``/etc`` files and a generated ``/etc/passwd``; ``/proc`` of its own PID namespace; a minimal,
read-only ``/dev`` whose only writable parts are a size-capped ``/dev/shm`` and a private
``/dev/mqueue`` (so POSIX message queues can be listed and emptied on reset); a size-capped
private ``/tmp``; scratch at ``/sandbox`` (writable, its cwd); no network interface but a
loopback of its own; its own hostname, IPC and PID namespaces, so it can see and signal only
its own processes, which all die with it; the seccomp filter of ``_seccomp.py``.

- ``bwrap`` (bubblewrap): works unprivileged through a user namespace; ~2-4 ms of setup.
- ``unshare`` (util-linux) + ``mount`` + ``chroot`` + ``setpriv``: needs root; ~10+ ms, as
  each mount is a separate exec. Used only where bubblewrap is missing.

Each builder returns the argv that *follows* the launcher's ``exec`` (see ``_launch.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from sandboxes._seccomp import LOADER_SOURCE

__all__ = [
    "ETC_FILES",
    "GATED_ONE_SHOT_INIT",
    "GATE_INIT",
    "GO",
    "NETWORK_ETC_FILES",
    "ROOT_LINKS",
    "UNSHARE_DIR_ENV",
    "LaunchFds",
    "bwrap_argv",
    "etc_entries",
    "etc_mount_points",
    "probe",
    "unshare_argv",
]

ETC_FILES = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    "localtime",
    "timezone",
    "nsswitch.conf",
    "hosts",
    "mime.types",
)
"""Public /etc entries programs commonly need; nothing secret (no shadow, ssh, ssl keys)."""

NETWORK_ETC_FILES = ("resolv.conf", "ssl", "ca-certificates", "gai.conf")
"""Added only when ``Limits.network`` is on."""


def _root_layout() -> tuple[list[tuple[str, str]], list[str]]:
    """Host top-level entries to mirror: (symlinks name->target, real dirs to bind)."""
    links, dirs = [], []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/") / name
        if path.is_symlink():
            links.append((name, os.readlink(path)))
        elif path.is_dir():
            dirs.append(name)
    return links, dirs


ROOT_LINKS, ROOT_DIRS = _root_layout()


def etc_entries(network: bool) -> list[str]:
    """The public ``/etc`` entries a sandbox sees that this host has."""
    names = ETC_FILES + (NETWORK_ETC_FILES if network else ())
    return [n for n in names if os.path.lexists(f"/etc/{n}")]


def etc_mount_points(network: bool, ro_binds: Sequence[str]) -> list[str]:
    """Host paths under ``/etc/`` that bwrap binds over the ``/etc`` copy (``_etc_view.py``):
    the network entries and the sandbox's own ``ro_binds`` there."""
    network_entries = [f"/etc/{n}" for n in etc_entries(network) if n in NETWORK_ETC_FILES]
    return network_entries + [path for path in ro_binds if path.startswith("/etc/")]


def bwrap_argv(
    *,
    fds: LaunchFds,
    tmp_mb: int,
    network: bool,
    userns: bool,
    ro_binds: Sequence[str],
    as_pid_1: bool = False,
    hostname: str = "sandbox",
    gated: bool = False,
) -> list[str]:
    """``bwrap ... --`` (the caller appends the command and passes ``fds`` to the child).
    ``gated``: the one-shot init waits for ``GO`` on stdin (``_launch._CgroupGate``).

    Host paths stay out of the sandbox's view: scratch and ``/etc`` (``_etc_view.py``) are
    bound from open fds, so ``/proc/1/cmdline`` names no host path and
    ``/proc/self/mountinfo`` no sandbox's directory. ``as_pid_1`` (the warm executor): the
    command itself is PID 1, with no init that later runs could attach to and rewrite; PID 1
    ignores signals from inside that it has no handler for. A one-shot command runs under a
    shell that is PID 1 and waits for it (as PID 1 the command would lose default signal
    actions: no SIGXCPU at the CPU limit, no SIGPIPE). Not bubblewrap's own init: it reports
    the exit status and its monitor exits without reaping it, so each run left a zombie for the
    host's PID 1, counted against the sandbox uid's process cap until then (late on some hosts,
    never in a container whose PID 1 does not reap).
    """
    argv = [
        shutil.which("bwrap") or "bwrap",
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--hostname",
        hostname,
    ]
    if network:
        argv.append("--share-net")
    if userns:
        argv += ["--unshare-user", "--uid", "1000", "--gid", "1000", "--disable-userns"]
    argv.append("--as-pid-1")
    if fds.seccomp is not None:
        argv += ["--seccomp", str(fds.seccomp)]
    argv += ["--ro-bind", "/usr", "/usr"]
    for name, target in ROOT_LINKS:
        argv += ["--symlink", target, f"/{name}"]
    for name in ROOT_DIRS:
        argv += ["--ro-bind", f"/{name}", f"/{name}"]
    argv += ["--ro-bind-fd", str(fds.etc), "/etc"]  # see _etc_view.py
    for name in etc_entries(network):
        if name in NETWORK_ETC_FILES:  # on a placeholder in the copy: etc_mount_points
            argv += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    for path in ro_binds:
        argv += ["--ro-bind", path, path]
    size = str(tmp_mb << 20)
    argv += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        size,
        "--tmpfs",
        "/dev/shm",
        "--dir",
        "/dev/mqueue",
        "--mqueue",
        "/dev/mqueue",
        "--remount-ro",
        "/dev",
        "--size",
        size,
        "--tmpfs",
        "/tmp",
        "--bind-fd",
        str(fds.scratch),
        "/sandbox",
        "--chdir",
        "/sandbox",
        "--remount-ro",
        "/",
        "--",
    ]
    return argv if as_pid_1 else [*argv, *(GATED_ONE_SHOT_INIT if gated else ONE_SHOT_INIT)]


ONE_SHOT_INIT = ("/bin/sh", "-c", '"$@"; exit $?', "envhub-init")
"""PID 1 of a one-shot bwrap run: runs the command as its child and exits with its status (the
``exit`` keeps the shell from exec'ing the command in its place)."""

GO = b"go\n"
"""The line a gated launch's PID 1 reads on stdin before it runs anything (``_launch.py``)."""
_WAIT_FOR_GO = 'IFS= read -r go && [ "$go" = go ] || exit 125'
GATED_ONE_SHOT_INIT = ("/bin/sh", "-c", f'{_WAIT_FOR_GO}; "$@"; exit $?', "envhub-init")
"""``ONE_SHOT_INIT`` that first waits for ``GO`` (end of file: exits 125, running nothing)."""
GATE_INIT = ("/bin/sh", "-c", f'{_WAIT_FOR_GO}; exec "$@"', "envhub-init")
"""For a command that is PID 1 itself (the warm executor): waits for ``GO``, then becomes it."""


@dataclasses.dataclass(frozen=True)
class LaunchFds:
    """Open fds a bwrap launch reads (each is passed to the child and closed after the spawn)."""

    scratch: int
    etc: int
    """The directory of ``_etc_view.etc_view``."""
    seccomp: int | None

    def all(self) -> tuple[int, ...]:
        return tuple(fd for fd in (self.scratch, self.etc, self.seccomp) if fd is not None)


_UNSHARE_SCRIPT = r"""
set -e
mount() {{ {mount} "$@"; }}
D="$ENVHUB_SANDBOX_DIR"; unset ENVHUB_SANDBOX_DIR
R="$D/root"
mount -t tmpfs -o size=1m,mode=755 envhub-root "$R"
mkdir "$R/usr" "$R/proc" "$R/dev" "$R/tmp" "$R/etc" "$R/sandbox"
robind() {{ mount --bind "$1" "$2"; mount -o remount,bind,ro,nosuid,nodev "$2"; }}
robind /usr "$R/usr"
{links}
for d in {dirs}; do mkdir "$R/$d"; robind "/$d" "$R/$d"; done
for f in {etc}; do
  if [ -d "/etc/$f" ]; then mkdir "$R/etc/$f"; else : > "$R/etc/$f"; fi
  robind "/etc/$f" "$R/etc/$f"
done
for f in passwd group; do cat "$D/etc/$f" > "$R/etc/$f"; chmod 644 "$R/etc/$f"; done
{ro_binds}
mount -t proc -o nosuid,nodev,noexec proc "$R/proc"
mount -t tmpfs -o size=64k,mode=755,nosuid dev "$R/dev"
for d in null zero full random urandom; do : > "$R/dev/$d"; mount --bind "/dev/$d" "$R/dev/$d"; done
ln -s /proc/self/fd "$R/dev/fd"
ln -s fd/0 "$R/dev/stdin"; ln -s fd/1 "$R/dev/stdout"; ln -s fd/2 "$R/dev/stderr"
mkdir "$R/dev/shm" "$R/dev/mqueue"
mount -t tmpfs -o size={tmp_mb}m,mode=1777,nosuid,nodev envhub-shm "$R/dev/shm"
mount -t mqueue -o nosuid,nodev,noexec mqueue "$R/dev/mqueue"
mount -o remount,ro "$R/dev"
mount -t tmpfs -o size={tmp_mb}m,mode=1777,nosuid,nodev envhub-tmp "$R/tmp"
mount --bind "$D/scratch" "$R/sandbox"
mount -o remount,ro "$R"
{hostname_cmd} {hostname}
{net_up}
set +e
{exec}{chroot} "$R" /usr/bin/setpriv --reuid={uid} --regid={uid} --clear-groups \
  --bounding-set=-all --inh-caps=-all --no-new-privs -- \
  {filter}/bin/sh -c 'cd /sandbox && exec "$@"' sh "$@"
"""


UNSHARE_DIR_ENV = "ENVHUB_SANDBOX_DIR"
"""The launcher's environment variable naming the sandbox's host directory (with ``root/``,
``scratch/``, ``etc/``) for ``unshare_argv``'s script: kept out of the script's text, so that
the sandbox's ``/proc/1/cmdline`` names no host path; unset before the command runs."""


def unshare_argv(
    *,
    tmp_mb: int,
    network: bool,
    uid: int,
    ro_binds: Sequence[str],
    seccomp: bytes | None,
    as_pid_1: bool = False,
    hostname: str = "sandbox",
) -> list[str]:
    """``unshare ... sh -c SCRIPT envhub-sandbox`` (the caller appends the command).

    The script runs as root in the new mount/PID namespaces, builds the root described in the
    module docstring in the directory the launcher's ``UNSHARE_DIR_ENV`` names, then runs the
    command as ``uid`` chrooted, with no capabilities,
    ``no_new_privs`` and the ``seccomp`` program (installed by ``_seccomp.LOADER_SOURCE``). The
    script stays PID 1 (as root: out of the command's reach) in the foreground, so orphans die
    with it when it returns; ``as_pid_1`` execs the command in its place instead, as in
    ``bwrap_argv``.
    """
    q = shlex.quote
    links = "\n".join(f'ln -s {q(target)} "$R/{name}"' for name, target in ROOT_LINKS)
    binds = "\n".join(f'mkdir -p "$R"{q(p)}; robind {q(p)} "$R"{q(p)}' for p in ro_binds)
    loader = (
        "" if seccomp is None else f"/usr/bin/python3 -I -S -c {q(LOADER_SOURCE)} {seccomp.hex()} "
    )
    script = _UNSHARE_SCRIPT.format(
        links=links,
        dirs=" ".join(ROOT_DIRS) or "",
        etc=" ".join(map(q, etc_entries(network))),
        ro_binds=binds,
        tmp_mb=int(tmp_mb),
        uid=int(uid),
        hostname=q(hostname),
        net_up="" if network else f"{q(_tool('ip'))} link set lo up 2>/dev/null || true",
        mount=q(_tool("mount")),
        chroot=q(_tool("chroot")),
        hostname_cmd=q(_tool("hostname")),
        exec="exec " if as_pid_1 else "",
        filter=loader,
    )
    namespaces = [
        "--mount",
        "--uts",
        "--ipc",
        "--pid",
        "--fork",
        "--kill-child",
        "--propagation",
        "private",
    ]
    if not network:
        namespaces.append("--net")
    return [
        shutil.which("unshare") or "unshare",
        *namespaces,
        "--",
        "/bin/sh",
        "-c",
        script,
        "envhub-sandbox",
    ]


def _tool(name: str) -> str:
    """Absolute path of a setup tool (the sandbox's PATH lacks the sbin directories)."""
    return shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin") or name


@functools.cache
def probe(kind: str, uid: int | None) -> str | None:
    """Why ``kind`` ("bwrap" / "unshare") cannot run here (None when it can). Cached per process."""
    if kind == "bwrap":
        exe = shutil.which("bwrap")
        if exe is None:
            return "bubblewrap is not installed (apt-get install -y bubblewrap)"
        cmd = [exe, "--unshare-all", "--ro-bind", "/usr", "/usr", "--proc", "/proc"]
        for name, target in ROOT_LINKS:
            cmd += ["--symlink", target, f"/{name}"]
        for name in ROOT_DIRS:
            cmd += ["--ro-bind", f"/{name}", f"/{name}"]
        cmd += ["--", "/usr/bin/true"]
    elif kind == "unshare":
        if os.geteuid() != 0:
            return "the unshare fallback needs root (it mounts the sandbox's root itself)"
        missing = [t for t in ("unshare", "setpriv", "chroot", "mount") if _tool(t) == t]
        if missing:
            return f"util-linux/coreutils tools missing: {', '.join(missing)}"
        cmd = [
            shutil.which("unshare") or "unshare",
            "--mount",
            "--pid",
            "--net",
            "--fork",
            "--propagation",
            "private",
            "--",
            "/bin/sh",
            "-c",
            "mount -t tmpfs x /mnt && true",
        ]
    else:
        raise ValueError(kind)
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            check=False,  # the exit code is the answer, read below
            timeout=20,
            user=uid,
            group=uid,
            extra_groups=[] if uid else None,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{cmd[0]} failed to start: {e}"
    if proc.returncode != 0:
        stderr = proc.stderr.decode(errors="replace").strip()[:300]
        return f"{' '.join(cmd[:3])} ... exited {proc.returncode}: {stderr}"
    return None
