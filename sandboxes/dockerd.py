"""A throwaway Docker engine and a registry-free image, for tests, benchmarks and CI.

``private_dockerd()`` starts ``dockerd`` as root with its own data root, exec root and
socket, no iptables and no bridge (so it touches nothing of the host's networking), waits for
it, and stops it by pid on exit, detaching whatever it left mounted. ``import_host_image()``
builds an image with ``docker import`` from a tiny rootfs whose ``/usr`` is meant to be
bind-mounted read-only from the host (``volumes=HOST_USR_RO``), so no registry is needed.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sandboxes.errors import SandboxUnavailableError

__all__ = ["HOST_IMAGE", "HOST_USR_RO", "import_host_image", "private_dockerd"]

HOST_USR_RO: dict[str, dict[str, str]] = {"/usr": {"bind": "/usr", "mode": "ro"}}
HOST_IMAGE = "envhub-sandbox-host:1"


@contextlib.contextmanager
def private_dockerd(start_timeout: float = 40.0) -> Iterator[str]:
    """Yield ``unix://...`` of a fresh dockerd; raise SandboxUnavailableError when it cannot run."""
    import docker

    exe = shutil.which("dockerd") or shutil.which("dockerd", path="/usr/sbin:/usr/bin")
    if exe is None:
        raise SandboxUnavailableError("dockerd is not installed (apt-get install -y docker.io)")
    if os.geteuid() != 0:
        raise SandboxUnavailableError("starting a private dockerd needs root")
    # short: socket paths max 107 bytes
    root = Path(tempfile.mkdtemp(prefix="envhub-dockerd-", dir="/tmp"))
    log = root / "dockerd.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                exe,
                "--data-root",
                str(root / "data"),
                "--exec-root",
                str(root / "exec"),
                "-H",
                f"unix://{root}/d.sock",
                "--pidfile",
                str(root / "d.pid"),
                "--iptables=false",
                "--ip6tables=false",
                "--bridge=none",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"unix://{root}/d.sock"
    client: Any = None
    try:
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                client = docker.DockerClient(base_url=url, timeout=60)
                client.ping()
                break
            except Exception:  # noqa: BLE001 - not up yet
                client = None
                time.sleep(0.3)
        if client is None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise SandboxUnavailableError(
                f"dockerd did not start within {start_timeout:.0f} s:\n{tail}"
            )
        yield url
    finally:
        if client is not None:
            with contextlib.suppress(Exception):
                for container in client.containers.list(all=True):
                    container.remove(force=True)
            client.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        _unmount_under(root)
        shutil.rmtree(root, ignore_errors=True)


def _unmount_under(root: Path) -> None:
    """Detach what a dockerd left mounted below ``root``: it bind-mounts its data root onto
    itself, and one that dies while starting (or is SIGKILLed) leaves that and its containers'
    mounts behind, which ``rmtree`` cannot remove."""
    import ctypes

    prefix = f"{root}/"
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]
    libc = ctypes.CDLL(None, use_errno=True)
    for point in sorted(points, key=len, reverse=True):  # innermost first
        libc.umount2(point.encode(), 2)  # MNT_DETACH


def _rootfs_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:

        def add(
            name: str,
            *,
            kind: bytes = tarfile.DIRTYPE,
            mode: int = 0o755,
            data: bytes = b"",
            link: str = "",
        ) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.linkname, info.size = kind, mode, link, len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)

        # sbin: docker-init is mounted there
        for d in (
            "usr",
            "etc",
            "proc",
            "dev",
            "sys",
            "sandbox",
            "sbin",
        ):
            add(d)
        add("tmp", mode=0o1777)
        for name in ("bin", "lib", "lib32", "lib64", "libx32"):
            if os.path.islink(f"/{name}"):
                add(name, kind=tarfile.SYMTYPE, link=os.readlink(f"/{name}"))
        add(
            "etc/passwd",
            kind=tarfile.REGTYPE,
            mode=0o644,
            data=b"root:x:0:0::/root:/bin/sh\nsandbox:x:1000:1000::/sandbox:/bin/sh\n"
            b"session:x:1001:1000::/sandbox:/bin/sh\nnobody:x:65534:65534::/:/bin/sh\n",
        )
        add(
            "etc/group",
            kind=tarfile.REGTYPE,
            mode=0o644,
            data=b"root:x:0:\nsandbox:x:1000:\nnogroup:x:65534:\n",
        )
        if os.path.exists("/etc/ld.so.cache"):
            add(
                "etc/ld.so.cache",
                kind=tarfile.REGTYPE,
                mode=0o644,
                data=Path("/etc/ld.so.cache").read_bytes(),
            )
    return buf.getvalue()


def import_host_image(base_url: str, name: str = HOST_IMAGE) -> str:
    """``docker import`` a rootfs that expects the host's /usr mounted read-only.

    Returns ``name``.
    """
    import docker

    repository, _, tag = name.partition(":")
    client = docker.DockerClient(base_url=base_url)
    try:
        client.api.import_image_from_data(_rootfs_tar(), repository=repository, tag=tag or "latest")
    finally:
        client.close()
    return name
