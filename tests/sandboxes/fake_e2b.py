"""A local stand-in for the E2B cloud, at the HTTP layer, for testing the ``e2b`` adapter.

One threaded WSGI server on 127.0.0.1 answers what the SDK sends (the SDK is pointed at it
with ``api_url=`` and ``sandbox_url=``):

- the control API: ``POST /v2/sandboxes`` (create), ``DELETE /sandboxes/{id}`` (kill);
- envd: ``GET /health``, ``GET/POST /files`` and the Connect-RPC ``process.Process`` service,
  served by the SDK's own generated ``ProcessWSGIApplication`` (so requests and responses are
  real protobuf over Connect). ``Start`` really runs the command with ``subprocess`` in a
  temp dir standing in for ``/home/user`` (tests only send commands they wrote);
- the code interpreter: ``POST /contexts`` and ``POST /execute`` (JSON lines), with a
  scripted kernel: ``exec`` in one globals dict per context.

Every request is recorded in ``FakeE2B.requests`` as (method, path, headers, body) so tests
can check what the adapter asked for.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import signal
import socketserver
import subprocess
import tempfile
import threading
import traceback
import uuid
from email.parser import BytesParser
from email.policy import HTTP
from pathlib import Path
from typing import Any, Self
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from e2b.envd.process import process_pb
from e2b.envd.process.process_connect import ProcessSync, ProcessWSGIApplication
from protobuf import Oneof

HOME = "/home/user"


class _Process(ProcessSync):
    """The fake envd's process service: runs commands for real, streams their output.
    Methods not overridden answer UNIMPLEMENTED (the adapter must not need them)."""

    def __init__(self, fake: FakeE2B) -> None:
        self.fake = fake
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def _host_path(self, path: str) -> str:
        return path.replace(HOME, str(self.fake.home), 1) if path.startswith(HOME) else path

    def start(self, request: Any, ctx: Any) -> Any:
        cfg = request.process
        # /home/user lives in a temp dir
        args = [a.replace(HOME, str(self.fake.home)) for a in cfg.args]
        self.fake.started.append(
            {"cmd": cfg.cmd, "args": list(cfg.args), "envs": dict(cfg.envs), "cwd": cfg.cwd}
        )
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **dict(cfg.envs)}
        proc = subprocess.Popen(
            [cfg.cmd, *args],
            cwd=self._host_path(cfg.cwd or HOME),
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


class FakeE2B:
    """Start with ``with FakeE2B() as fake:``; ``fake.options`` goes to ``E2BSandbox(**...)``."""

    def __init__(self) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="fake-e2b-home-"))
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self.created: list[dict[str, Any]] = []
        self.killed: list[str] = []
        self.started: list[dict[str, Any]] = []
        self.signals: list[tuple[int, Any]] = []
        self.contexts: dict[str, dict[str, Any]] = {}
        self._process = _Process(self)
        self._rpc = ProcessWSGIApplication(self._process)  # type: ignore[arg-type]
        self._server = make_server(
            "127.0.0.1", 0, self._app, server_class=_ThreadingServer, handler_class=_Quiet
        )
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def options(self) -> dict[str, Any]:
        return {"api_key": "e2b_test_key", "api_url": self.url, "sandbox_url": self.url}

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        for proc in self._process.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        import shutil

        shutil.rmtree(self.home, ignore_errors=True)

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
        if path.startswith("/process.Process/"):
            self.requests.append((method, path, headers, b""))
            return self._rpc(environ, start_response)
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length) if length else b""
        headers["content-type"] = environ.get("CONTENT_TYPE", "")
        self.requests.append((method, path, headers, body))
        query = {k: v[0] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}
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
        if method == "POST" and path == "/v2/sandboxes":
            if headers.get("x-api-key") != "e2b_test_key":
                return (
                    "401 Unauthorized",
                    json.dumps({"code": 401, "message": "Invalid API key"}).encode(),
                    "application/json",
                )
            request = json.loads(body)
            self.created.append(request)
            sandbox = {
                "sandboxID": f"fake{uuid.uuid4().hex[:8]}",
                "templateID": request.get("templateID", "x"),
                "clientID": "fake",
                "envdVersion": "0.4.0",
                "envdAccessToken": "envd-token",
            }
            return "201 Created", json.dumps(sandbox).encode(), "application/json"
        if method == "DELETE" and path.startswith("/sandboxes/"):
            self.killed.append(path.rsplit("/", 1)[1])
            return "204 No Content", b"", "text/plain"
        if path == "/health":
            return "204 No Content", b"", "text/plain"
        if path == "/files":
            return self._files(method, query, headers, body)
        if method == "POST" and path == "/contexts":
            request = json.loads(body)
            ctx_id = uuid.uuid4().hex[:8]
            self.contexts[ctx_id] = {"globals": {}, **request}
            return (
                "200 OK",
                json.dumps(
                    {
                        "id": ctx_id,
                        "language": request.get("language", "python"),
                        "cwd": request.get("cwd", HOME),
                    }
                ).encode(),
                "application/json",
            )
        if method == "DELETE" and path.startswith("/contexts/"):
            self.contexts.pop(path.rsplit("/", 1)[1], None)
            return "204 No Content", b"", "text/plain"
        if method == "POST" and path == "/execute":
            return "200 OK", self._execute(json.loads(body)), "application/x-ndjson"
        return (
            "404 Not Found",
            json.dumps({"code": 404, "message": f"no route {method} {path}"}).encode(),
            "application/json",
        )

    def _files(
        self, method: str, query: dict[str, str], headers: dict[str, str], body: bytes
    ) -> tuple[str, bytes, str]:
        if method == "GET":
            target = Path(self._process._host_path(query["path"]))
            if not target.is_file():
                return (
                    "404 Not Found",
                    json.dumps(
                        {"code": 404, "message": f"path '{query['path']}' does not exist"}
                    ).encode(),
                    "application/json",
                )
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
            target = Path(self._process._host_path(path))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            written.append({"name": target.name, "type": "file", "path": path})
        return "200 OK", json.dumps(written).encode(), "application/json"

    def _execute(self, request: dict[str, Any]) -> bytes:
        ctx = self.contexts.get(request.get("context_id") or "", {"globals": {}})
        out, err = io.StringIO(), io.StringIO()
        lines = []
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                exec(compile(request["code"], "<cell>", "exec"), ctx["globals"])  # noqa: S102 - test-authored code
        except Exception as e:  # noqa: BLE001
            lines.append(
                {
                    "type": "error",
                    "name": type(e).__name__,
                    "value": str(e),
                    "traceback": "Traceback...",
                }
            )
        if out.getvalue():
            lines.insert(0, {"type": "stdout", "text": out.getvalue(), "timestamp": 0})
        if err.getvalue():
            lines.insert(1, {"type": "stderr", "text": err.getvalue(), "timestamp": 0})
        lines.append({"type": "end_of_execution"})
        return "".join(json.dumps(line) + "\n" for line in lines).encode()
