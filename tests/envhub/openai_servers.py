"""OpenAI-compatible servers for eval tests: vLLM's real one, and a scripted one.

``vllm_openai_server(model_dir)`` starts ``python -m vllm.entrypoints.openai.api_server`` (the
command the README gives) on a free loopback port with this machine's CPU settings.
``scripted_server(reply)`` serves ``/v1/models`` and ``/v1/chat/completions`` from a function
of the request body, to make a server misbehave on purpose (429s, malformed JSON, tool calls
with chosen ids); the ``openai`` client talks to both over real HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import Request  # at module level: FastAPI resolves the handler's annotations here
from fastapi.responses import JSONResponse, Response

from tests.envhub.pool.raycluster import free_port

VLLM_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TORCH_COMPILE_DISABLE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


@contextlib.contextmanager
def vllm_openai_server(
    model_dir: str | Path, *, tool_parser: str | None = "hermes", log: Path | None = None
) -> Iterator[str]:
    """vLLM's OpenAI server on ``model_dir``; yields its base URL (``http://127.0.0.1:P/v1``)."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    if tool_parser is not None:
        command += ["--enable-auto-tool-choice", "--tool-call-parser", tool_parser]
    process = subprocess.Popen(
        command, env={**os.environ, **VLLM_ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    ready = threading.Event()  # set when uvicorn says it is up, or when the output ends

    def copy_output() -> None:
        """Copy the server's output to ``log`` and signal its start-up line."""
        with open(log or os.devnull, "wb") as out:
            for line in process.stdout or ():
                out.write(line)
                out.flush()
                if b"Application startup complete" in line:
                    ready.set()
        ready.set()

    threading.Thread(target=copy_output, daemon=True).start()
    try:
        if not ready.wait(240):
            raise RuntimeError(f"vLLM's server did not start within 240 s; see {log}")
        if process.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with {process.returncode}; see {log}")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


Reply = Callable[[dict[str, Any]], Any]
"""Request body -> a chat completion dict, or a starlette ``Response`` to send as is."""


def completion(content: str = "", tool_calls: list[dict[str, Any]] | None = None) -> dict:
    """A chat completion body with one choice."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": "cmpl-test",
        "object": "chat.completion",
        "created": 0,
        "model": "scripted",
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if tool_calls else "stop",
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
    }


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class ScriptedServer:
    def __init__(self, url: str) -> None:
        self.url = url
        self.requests: list[dict[str, Any]] = []
        """Every chat-completions body received, in order."""


class _SignallingServer(uvicorn.Server):
    """A uvicorn server that sets ``up`` once it listens (instead of polling ``started``)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.up = threading.Event()

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        self.up.set()


@contextlib.contextmanager
def scripted_server(
    reply: Reply, models: tuple[str, ...] = ("scripted",), *, blocking: bool = False
) -> Iterator[ScriptedServer]:
    """Serve ``reply``; ``blocking``: it may block (wait on an event, take its time), so it runs
    in a worker thread and the server answers other requests meanwhile."""
    from fastapi import FastAPI
    from starlette.concurrency import run_in_threadpool

    app = FastAPI()
    port = free_port()
    state = ScriptedServer(f"http://127.0.0.1:{port}/v1")
    lock = threading.Lock()

    @app.get("/v1/models")
    def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": m, "object": "model"} for m in models]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        with lock:
            state.requests.append(body)
        answer = await run_in_threadpool(reply, body) if blocking else reply(body)
        return answer if isinstance(answer, Response) else JSONResponse(answer)

    with serve_app(app, port):
        yield state


@contextlib.contextmanager
def serve_app(app: Any, port: int | None = None) -> Iterator[str]:
    """Serve the ASGI ``app`` on loopback in a thread; yields ``http://127.0.0.1:PORT``."""
    port = port or free_port()
    server = _SignallingServer(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )

    def serve() -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(server.serve())
        finally:
            server.up.set()  # it failed to start: wake the waiter, which sees started False
            loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    if not server.up.wait(30) or not server.started:
        raise RuntimeError("the test server did not start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
