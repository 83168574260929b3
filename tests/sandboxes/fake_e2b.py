"""A local stand-in for the E2B cloud, at the HTTP layer, for testing the ``e2b`` adapter.

One threaded WSGI server on 127.0.0.1 answers what the SDK sends (the SDK is pointed at it
with ``api_url=`` and ``sandbox_url=``):

- the control API: ``POST /v2/sandboxes`` (create), ``GET /v2/sandboxes`` (list by
  metadata), ``DELETE /sandboxes/{id}`` (kill), ``POST /sandboxes/{id}/timeout``. Each
  sandbox is a fake VM (:class:`_Box`) with its own directories and a deadline: when it passes,
  or the VM is killed, its processes die and requests to it answer 502, as E2B's do. Deadlines
  read the fake's clock (:meth:`FakeE2B.now`), which a test moves with :meth:`FakeE2B.advance`
  instead of sleeping;
- envd: ``GET /health``, ``GET/POST /files`` and the Connect-RPC ``process.Process`` service,
  served by the SDK's own generated ``ProcessWSGIApplication`` (so requests and responses are
  real protobuf over Connect). ``Start`` really runs the command, under bubblewrap: the host is
  read-only and only the VM's ``/home/user``, ``/tmp``, ``/var/tmp``, ``/dev/shm`` (temp dirs
  bound there) are writable, so no command (not even ``find /tmp -delete``) touches the host;
- the code interpreter: ``POST /contexts``, ``/contexts/{id}/restart`` and ``/execute`` (JSON
  lines), with a scripted kernel (:class:`_Kernel`) that runs test-authored cells in-process.

Every request is recorded in ``FakeE2B.requests`` as (method, path, headers, body) so tests
can check what the adapter asked for.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import queue
import select
import shutil
import signal
import socketserver
import subprocess
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from email.parser import BytesParser
from email.policy import HTTP
from pathlib import Path
from typing import Any, Self
from urllib.parse import parse_qs, parse_qsl, unquote
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from e2b.envd.process import process_pb
from e2b.envd.process.process_connect import ProcessSync, ProcessWSGIApplication
from protobuf import Oneof

HOME = "/home/user"
MOUNTS = (HOME, "/tmp", "/var/tmp", "/dev/shm")
"""What a fake VM may write; the rest of the host is mounted read-only under bubblewrap."""


def _kill_marked(marker: bytes) -> None:
    """SIGKILL every process whose environment carries ``marker`` (a fake VM's processes)."""
    for _ in range(50):
        found = False
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0"):
                found = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(entry.name), signal.SIGKILL)
        if not found:
            return
        time.sleep(0.02)


class _Box:
    """One fake VM: its own /home/user, /tmp, /var/tmp and /dev/shm (host dirs under the fake's
    root, bind-mounted by bubblewrap), a deadline like E2B's sandbox timeout, its processes."""

    def __init__(self, root: Path, deadline: float, metadata: dict[str, str]) -> None:
        self.id = f"fake{uuid.uuid4().hex[:8]}"
        self.metadata = metadata
        self.deadline = deadline
        """On the fake's clock (:meth:`FakeE2B.now`)."""
        self.alive = True
        self.mounts = {
            where: root / self.id / where.strip("/").replace("/", "_") for where in MOUNTS
        }
        for host in self.mounts.values():
            host.mkdir(parents=True)
        self.marker = f"FAKE_E2B_SANDBOX={self.id}".encode()

    def kill(self) -> None:
        self.alive = False
        _kill_marked(self.marker)

    def host_path(self, path: str) -> Path | None:
        """Where ``path`` (as the VM sees it) lives on the host; None outside the VM's mounts
        (so the files API can never reach a host file, even through a symlink or ``..``)."""
        for where, host in self.mounts.items():
            if path == where or path.startswith(where + "/"):
                target = (host / path[len(where) :].lstrip("/")).resolve()
                return target if target.is_relative_to(host.resolve()) else None
        return None

    def argv(self, cmd: str, args: list[str], cwd: str) -> list[str]:
        """``cmd args`` confined by bubblewrap: the host is read-only, the VM's dirs writable."""
        binds = [a for where, host in self.mounts.items() for a in ("--bind", str(host), where)]
        return [
            "bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/home",
            *binds, "--cap-drop", "ALL", "--chdir", cwd, "--", cmd, *args,
        ]  # fmt: skip


class _Process(ProcessSync):
    """The fake envd's process service: runs commands for real (confined by bubblewrap to the
    fake VM's directories), streams their output. Methods not overridden answer UNIMPLEMENTED
    (the adapter must not need them)."""

    def __init__(self, fake: FakeE2B) -> None:
        self.fake = fake
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, request: Any, ctx: Any) -> Any:
        cfg = request.process
        box = self.fake.current_box()
        self.fake.started.append(
            {"cmd": cfg.cmd, "args": list(cfg.args), "envs": dict(cfg.envs), "cwd": cfg.cwd}
        )
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            **dict(cfg.envs),
            "FAKE_E2B_SANDBOX": box.id,
        }
        proc = subprocess.Popen(
            box.argv(cfg.cmd, list(cfg.args), cfg.cwd or HOME),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.procs[proc.pid] = proc
        Event = process_pb.ProcessEvent
        yield process_pb.StartResponse(
            event=Event(event=Oneof("start", Event.StartEvent(pid=proc.pid)))
        )
        streams = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}  # type: ignore[union-attr]
        while streams:
            ready, _, _ = select.select(list(streams), [], [], 0.5)
            for fd in ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    del streams[fd]
                    continue
                data = Event.DataEvent(output=Oneof(streams[fd], chunk))
                yield process_pb.StartResponse(event=Event(event=Oneof("data", data)))
        code = proc.wait()
        end = Event.EndEvent(
            exit_code=code if code >= 0 else -1, exited=code >= 0, status=f"exit status {code}"
        )
        yield process_pb.StartResponse(event=Event(event=Oneof("end", end)))

    def send_signal(self, request: Any, ctx: Any) -> Any:
        pid = request.process.selector.value
        self.fake.signals.append((pid, request.signal))
        if pid in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        return process_pb.SendSignalResponse()


def _dechunk(stream: Any) -> bytes:
    body = bytearray()
    while True:
        size = int(stream.readline().split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while stream.readline() not in (b"\r\n", b"\n", b""):
                pass
            return bytes(body)
        body += stream.read(size)
        stream.readline()


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Kernel:
    """A scripted code-interpreter context: cells ``exec`` in one globals dict, one at a time
    (a cell queues behind a running one, as in Jupyter); ``print`` streams each call as one
    stdout message. A restart gives a new kernel: the running cell's next ``print`` raises,
    its output is dropped. Only test-authored code runs here (in this process)."""

    def __init__(self) -> None:
        self.globals: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.generation = 0

    def restart(self) -> None:
        self.globals, self.lock, self.generation = {}, threading.Lock(), self.generation + 1

    def execute(self, code: str) -> Iterator[bytes]:
        lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        generation, lock, cell_globals = self.generation, self.lock, self.globals

        def emit(*args: Any, **kw: Any) -> None:
            if self.generation != generation:
                raise SystemExit("kernel restarted")
            text = kw.get("sep", " ").join(map(str, args)) + kw.get("end", "\n")
            lines.put({"type": "stdout", "text": text, "timestamp": 0})

        def cell() -> None:
            with lock:
                cell_globals["print"] = emit
                try:
                    exec(compile(code, "<cell>", "exec"), cell_globals)  # noqa: S102 - test-authored code
                except Exception as e:  # noqa: BLE001
                    lines.put(
                        {"type": "error", "name": type(e).__name__, "value": str(e),
                         "traceback": "Traceback..."}
                    )  # fmt: skip
                except SystemExit:
                    pass
                lines.put(None)

        threading.Thread(target=cell, daemon=True).start()
        while (line := lines.get()) is not None:
            yield (json.dumps(line) + "\n").encode()
        yield (json.dumps({"type": "end_of_execution"}) + "\n").encode()


class FakeE2B:
    """Start with ``with FakeE2B() as fake:``; ``fake.options`` goes to ``E2BSandbox(**...)``.

    Safe by construction: every command runs under bubblewrap with the host read-only and only
    the fake VM's own directories (under a temp root) writable, and the files API serves only
    those directories. Without a working ``bwrap`` the fake refuses to start.
    """

    def __init__(self) -> None:
        probe = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "true"]
        try:
            done = subprocess.run(probe, check=False, capture_output=True, timeout=30)
            usable = done.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            usable = False
        if not usable:
            raise RuntimeError("the fake E2B confines commands with bubblewrap; install bwrap")
        self.root = Path(tempfile.mkdtemp(prefix="fake-e2b-"))
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self.created: list[dict[str, Any]] = []
        self.killed: list[str] = []
        self.timeouts: list[tuple[str, int]] = []
        self.started: list[dict[str, Any]] = []
        self.signals: list[tuple[int, Any]] = []
        self.boxes: dict[str, _Box] = {}
        self.contexts: dict[str, _Kernel] = {}
        self._skipped = 0.0
        """Seconds :meth:`advance` has moved the clock past ``time.monotonic()``."""
        self.break_create_response = False
        """Answer the next create with a body the SDK cannot parse (after creating the VM)."""
        self._local = threading.local()
        self._process = _Process(self)
        self._rpc = ProcessWSGIApplication(self._process)  # type: ignore[arg-type]
        self._server = make_server(
            "127.0.0.1", 0, self._app, server_class=_ThreadingServer, handler_class=_Quiet
        )
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(  # shutdown() waits up to one poll_interval
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def options(self) -> dict[str, Any]:
        return {"api_key": "e2b_test_key", "api_url": self.url, "sandbox_url": self.url}

    @property
    def alive(self) -> list[str]:
        """Ids of the fake VMs still running (not killed, not expired)."""
        self._expire()
        return [box.id for box in self.boxes.values() if box.alive]

    def now(self) -> float:
        """The clock of VM deadlines: ``time.monotonic()`` plus what :meth:`advance` skipped.
        The ``fake`` fixture makes the adapter's lifetime bookkeeping read it too."""
        return time.monotonic() + self._skipped

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` forward; VMs whose deadline it passes die now, as E2B's
        timer would kill them."""
        self._skipped += seconds
        self._expire()

    def files(self, sandbox_id: str) -> dict[str, bytes]:
        """Every file that fake VM ``sandbox_id`` can write (its only own files), by its path
        in the VM."""
        found = {}
        for where, host in self.boxes[sandbox_id].mounts.items():
            for path in host.rglob("*"):
                with contextlib.suppress(OSError):
                    if path.is_file():
                        found[f"{where}/{path.relative_to(host)}"] = path.read_bytes()
        return found

    def running(self, sandbox_id: str) -> list[int]:
        """Pids of the processes still running in fake VM ``sandbox_id``."""
        marker = self.boxes[sandbox_id].marker
        pids = []
        for entry in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                if entry.name.isdigit() and marker in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
        return pids

    def current_box(self) -> _Box:
        box: _Box = self._local.box
        return box

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        for box in self.boxes.values():
            box.kill()
        for proc in self._process.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for ctx in self.contexts.values():
            ctx.restart()
        shutil.rmtree(self.root, ignore_errors=True)

    def _expire(self) -> None:
        for box in self.boxes.values():
            if box.alive and self.now() > box.deadline:
                box.kill()

    # ---- routing ---------------------------------------------------------------------------
    def _app(self, environ: dict[str, Any], start_response: Any) -> Any:
        path, method = environ["PATH_INFO"], environ["REQUEST_METHOD"]
        headers = {
            k[5:].replace("_", "-").lower(): v for k, v in environ.items() if k.startswith("HTTP_")
        }
        # wsgiref does not de-chunk request bodies
        if headers.get("transfer-encoding") == "chunked":
            raw = _dechunk(environ["wsgi.input"])
            environ["wsgi.input"], environ["CONTENT_LENGTH"] = io.BytesIO(raw), str(len(raw))
            del environ["HTTP_TRANSFER_ENCODING"]
        self._expire()
        box = self.boxes.get(headers.get("e2b-sandbox-id", ""))
        if "e2b-sandbox-id" in headers and (box is None or not box.alive):
            self.requests.append((method, path, headers, b""))
            message = json.dumps({"code": 502, "message": "The sandbox was not found"}).encode()
            start_response("502 Bad Gateway", [("Content-Type", "application/json")])
            return [message]
        self._local.box = box
        if path.startswith("/process.Process/"):
            self.requests.append((method, path, headers, b""))
            return self._rpc(environ, start_response)
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length) if length else b""
        headers["content-type"] = environ.get("CONTENT_TYPE", "")
        self.requests.append((method, path, headers, body))
        query = {k: v[0] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}
        if method == "POST" and path == "/execute":
            start_response("200 OK", [("Content-Type", "application/x-ndjson")])
            request = json.loads(body)
            return self.contexts[request["context_id"]].execute(request["code"])
        try:
            status, payload, ctype = self._route(method, path, query, headers, body)
        except Exception:  # noqa: BLE001 - a bug in the fake must be visible
            status, payload, ctype = (
                "500 Internal Server Error",
                traceback.format_exc().encode(),
                "text/plain",
            )
        start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(payload)))])
        return [payload]

    def _route(
        self, method: str, path: str, query: dict[str, str], headers: dict[str, str], body: bytes
    ) -> tuple[str, bytes, str]:
        as_json = "application/json"
        if path.startswith(("/v2/sandboxes", "/sandboxes")) and headers.get("x-api-key") != (
            "e2b_test_key"
        ):
            return "401 Unauthorized", b'{"code": 401, "message": "Invalid API key"}', as_json
        if method == "POST" and path == "/v2/sandboxes":
            request = json.loads(body)
            self.created.append(request)
            deadline = self.now() + request.get("timeout", 15)
            box = _Box(self.root, deadline, request.get("metadata") or {})
            self.boxes[box.id] = box
            sandbox = {
                "sandboxID": box.id,
                "templateID": request.get("templateID", "x"),
                "clientID": "fake",
                "envdVersion": "not a version" if self.break_create_response else "0.4.0",
                "envdAccessToken": "envd-token",
            }
            self.break_create_response = False
            return "201 Created", json.dumps(sandbox).encode(), as_json
        if method == "GET" and path == "/v2/sandboxes":
            wanted = dict(parse_qsl(unquote(query.get("metadata", ""))))
            listed = [
                {"sandboxID": box.id, "templateID": "x", "clientID": "fake",
                 "startedAt": "2026-01-01T00:00:00Z", "endAt": "2026-01-01T01:00:00Z",
                 "cpuCount": 2, "memoryMB": 512, "diskSizeMB": 1024, "state": "running",
                 "envdVersion": "0.4.0", "metadata": box.metadata}
                for box in self.boxes.values()
                if box.alive and wanted.items() <= box.metadata.items()
            ]  # fmt: skip
            return "200 OK", json.dumps(listed).encode(), as_json
        if path.startswith("/sandboxes/"):
            box = self.boxes.get(path.split("/")[2])
            if box is None or not box.alive:
                return "404 Not Found", b'{"code": 404, "message": "sandbox not found"}', as_json
            if method == "DELETE":
                self.killed.append(box.id)
                box.kill()
                return "204 No Content", b"", "text/plain"
            if method == "POST" and path.endswith("/timeout"):
                timeout = json.loads(body)["timeout"]
                self.timeouts.append((box.id, timeout))
                box.deadline = self.now() + timeout
                return "204 No Content", b"", "text/plain"
        if path == "/health":
            return "204 No Content", b"", "text/plain"
        if path == "/files":
            return self._files(method, query, headers, body)
        if method == "POST" and path == "/contexts":
            request = json.loads(body)
            ctx_id = uuid.uuid4().hex[:8]
            self.contexts[ctx_id] = _Kernel()
            reply = {
                "id": ctx_id,
                "language": request.get("language", "python"),
                "cwd": request.get("cwd", HOME),
            }
            return "200 OK", json.dumps(reply).encode(), as_json
        if method == "POST" and path.startswith("/contexts/") and path.endswith("/restart"):
            self.contexts[path.split("/")[2]].restart()
            return "204 No Content", b"", "text/plain"
        if method == "DELETE" and path.startswith("/contexts/"):
            kernel = self.contexts.pop(path.rsplit("/", 1)[1], None)
            if kernel is not None:
                kernel.restart()
            return "204 No Content", b"", "text/plain"
        message = {"code": 404, "message": f"no route {method} {path}"}
        return "404 Not Found", json.dumps(message).encode(), as_json

    def _files(
        self, method: str, query: dict[str, str], headers: dict[str, str], body: bytes
    ) -> tuple[str, bytes, str]:
        box = self.current_box()

        def refuse(path: str, code: str = "404 Not Found") -> tuple[str, bytes, str]:
            message = {"code": int(code[:3]), "message": f"path '{path}' does not exist"}
            return code, json.dumps(message).encode(), "application/json"

        if method == "GET":
            target = box.host_path(query["path"])
            if target is None or not target.is_file():
                return refuse(query["path"])
            return "200 OK", target.read_bytes(), "application/octet-stream"
        written = []
        if headers["content-type"].startswith("multipart/"):
            message = BytesParser(policy=HTTP).parsebytes(
                f"Content-Type: {headers['content-type']}\r\n\r\n".encode() + body
            )
            parts = [
                (part.get_filename() or query.get("path"), part.get_payload(decode=True))
                for part in message.iter_parts()
            ]
        else:
            parts = [(query["path"], body)]
        for name, data in parts:
            path = name if name.startswith("/") else query.get("path", name)
            target = box.host_path(path)
            if target is None:
                return refuse(path, "403 Forbidden")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            written.append({"name": target.name, "type": "file", "path": path})
        return "200 OK", json.dumps(written).encode(), "application/json"
