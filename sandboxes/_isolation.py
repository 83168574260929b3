"""Command lines that put one process into a fresh set of Linux namespaces.

Two ways, same result (what the sandboxed program sees):

``/`` read-only with only ``/usr`` (plus the ``/bin``, ``/lib*`` links), a handful of public
``/etc`` files and a generated ``/etc/passwd``; ``/proc`` of its own PID namespace; a minimal
``/dev``; a size-capped private ``/tmp``; scratch at ``/sandbox`` (writable, its cwd); no
network interface but a loopback of its own; its own hostname, IPC and PID namespaces, so
it can see and signal only its own processes, which all die with it.

- ``bwrap`` (bubblewrap): works unprivileged through a user namespace; ~2-4 ms of setup.
- ``unshare`` (util-linux) + ``mount`` + ``chroot`` + ``setpriv``: needs root; ~10+ ms, as
  each mount is a separate exec. Used only where bubblewrap is missing.

Each builder returns the argv that *follows* the launcher's ``exec`` (see ``local.py``).
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ETC_FILES", "ROOT_LINKS", "bwrap_argv", "unshare_argv", "probe"]

ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "timezone",
             "nsswitch.conf", "hosts", "mime.types")
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


def _etc_entries(network: bool) -> list[str]:
    names = ETC_FILES + (NETWORK_ETC_FILES if network else ())
    return [n for n in names if os.path.lexists(f"/etc/{n}")]


def bwrap_argv(*, scratch: Path, etc_dir: Path, tmp_mb: int, network: bool, userns: bool,
               ro_binds: Sequence[str], hostname: str = "sandbox") -> list[str]:
    """``bwrap ... --`` (the caller appends the command)."""
    argv = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--die-with-parent", "--new-session",
            "--hostname", hostname]
    if network:
        argv.append("--share-net")
    if userns:
        argv += ["--unshare-user", "--uid", "1000", "--gid", "1000", "--disable-userns"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for name, target in ROOT_LINKS:
        argv += ["--symlink", target, f"/{name}"]
    for name in ROOT_DIRS:
        argv += ["--ro-bind", f"/{name}", f"/{name}"]
    for name in _etc_entries(network):
        argv += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    argv += ["--ro-bind", str(etc_dir / "passwd"), "/etc/passwd", "--ro-bind", str(etc_dir / "group"), "/etc/group"]
    for path in ro_binds:
        argv += ["--ro-bind", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(tmp_mb << 20), "--tmpfs", "/tmp",
             "--bind", str(scratch), "/sandbox", "--chdir", "/sandbox", "--remount-ro", "/", "--"]
    return argv


_UNSHARE_SCRIPT = r"""
set -e
mount() {{ {mount} "$@"; }}
R={root}
mount -t tmpfs -o size=1m,mode=755 envhub-root "$R"
mkdir "$R/usr" "$R/proc" "$R/dev" "$R/tmp" "$R/etc" "$R/sandbox"
robind() {{ mount --bind "$1" "$2"; mount -o remount,bind,ro,nosuid,nodev "$2"; }}
robind /usr "$R/usr"
{links}
for d in {dirs}; do mkdir "$R/$d"; robind "/$d" "$R/$d"; done
for f in {etc}; do
  if [ -d "/etc/$f" ]; then mkdir "$R/etc/$f"; else : > "$R/etc/$f"; fi; robind "/etc/$f" "$R/etc/$f"
done
for f in passwd group; do : > "$R/etc/$f"; robind {etc_dir}/$f "$R/etc/$f"; done
{ro_binds}
mount -t proc -o nosuid,nodev,noexec proc "$R/proc"
mount -t tmpfs -o size=64k,mode=755,nosuid dev "$R/dev"
for d in null zero full random urandom; do : > "$R/dev/$d"; mount --bind "/dev/$d" "$R/dev/$d"; done
ln -s /proc/self/fd "$R/dev/fd"; ln -s fd/0 "$R/dev/stdin"; ln -s fd/1 "$R/dev/stdout"; ln -s fd/2 "$R/dev/stderr"
mount -t tmpfs -o size={tmp_mb}m,mode=1777,nosuid,nodev envhub-tmp "$R/tmp"
mount --bind {scratch} "$R/sandbox"
mount -o remount,ro "$R"
{hostname_cmd} {hostname}
{net_up}
set +e
{chroot} "$R" /usr/bin/setpriv --reuid={uid} --regid={uid} --clear-groups --bounding-set=-all \
  --inh-caps=-all --no-new-privs -- /bin/sh -c 'cd /sandbox && exec "$@"' sh "$@"
"""


def unshare_argv(*, root: Path, scratch: Path, etc_dir: Path, tmp_mb: int, network: bool, uid: int,
                 ro_binds: Sequence[str], hostname: str = "sandbox") -> list[str]:
    """``unshare ... sh -c SCRIPT envhub-sandbox`` (the caller appends the command).

    The script runs as root in the new mount/PID namespaces, builds the root described in the
    module docstring, then runs the command in the foreground (staying PID 1, so orphans die with
    it when it returns); the command
    runs chrooted as ``uid`` with no capabilities and ``no_new_privs``.
    """
    q = shlex.quote
    links = "\n".join(f"ln -s {q(target)} \"$R/{name}\"" for name, target in ROOT_LINKS)
    binds = "\n".join(f"mkdir -p \"$R\"{q(p)}; robind {q(p)} \"$R\"{q(p)}" for p in ro_binds)
    script = _UNSHARE_SCRIPT.format(
        root=q(str(root)), links=links, dirs=" ".join(ROOT_DIRS) or "", etc=" ".join(map(q, _etc_entries(network))),
        etc_dir=q(str(etc_dir)), ro_binds=binds, tmp_mb=int(tmp_mb), scratch=q(str(scratch)), uid=int(uid),
        hostname=q(hostname), net_up="" if network else f"{q(_tool('ip'))} link set lo up 2>/dev/null || true",
        mount=q(_tool("mount")), chroot=q(_tool("chroot")), hostname_cmd=q(_tool("hostname")))
    namespaces = ["--mount", "--uts", "--ipc", "--pid", "--fork", "--kill-child", "--propagation", "private"]
    if not network:
        namespaces.append("--net")
    return [shutil.which("unshare") or "unshare", *namespaces, "--", "/bin/sh", "-c", script, "envhub-sandbox"]


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
        cmd = [shutil.which("unshare") or "unshare", "--mount", "--pid", "--net", "--fork", "--propagation", "private",
               "--", "/bin/sh", "-c", "mount -t tmpfs x /mnt && true"]
    else:
        raise ValueError(kind)
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=20, user=uid, group=uid,
                              extra_groups=[] if uid else None)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{cmd[0]} failed to start: {e}"
    if proc.returncode != 0:
        return f"{' '.join(cmd[:3])} ... exited {proc.returncode}: {proc.stderr.decode(errors='replace').strip()[:300]}"
    return None
