"""Black-box agents as the policy's harness: ``rollout.agent`` plays every episode.

An agent is the user's own code, written against the plain ``openai`` SDK: a function
(``rollout.agent.callable: "pkg.module:run_agent"``) or a program (``rollout.agent.command``).
For each episode the trainer resets the env, opens the episode on the proxy
(``trainer.rollout.proxy``) and hands the agent an ``AgentEpisode``::

    def run_agent(episode: AgentEpisode) -> str | None:
        client = episode.openai_client()        # an openai.OpenAI for this episode
        messages = list(episode.messages)
        while True:
            reply = client.chat.completions.create(
                model=episode.model, messages=messages, tools=episode.tools
            ).choices[0].message
            step = episode.env.step(reply)      # text or the message (its tool calls)
            messages += [reply.model_dump(exclude_none=True), *step.messages]
            if step.done:
                return None

(``openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key)`` works too, at ~20 ms per
client built for its TLS context: ``openai_client`` builds one without, that ignores
``HTTP_PROXY`` (the proxy is on loopback) and is closed when the episode ends; for an agent's
own clients the trainer adds loopback to its ``NO_PROXY``.) An ``async
def`` agent (``openai.AsyncOpenAI``, LangGraph, the openai-agents SDK) runs the same way, on an
event loop of its own in its thread (``asyncio.run``). A program gets the same object from
``AgentEpisode.from_environ()`` (``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and
``ENVHUB_AGENT_MODEL`` are set for it, and the proxy's host is added to ``NO_PROXY``, so its
own clients reach it on a host whose HTTP goes through an HTTP proxy). Returning a string
instead of stepping the env makes that string the episode's last action (the env, and any
reward function, scores it).

``AgentRunner`` is the env manager's stand-in for the scheduler (same ``run``): it runs the
agent (a daemon thread, or a subprocess in its own session, whose process group is killed when
it exits, so helpers it left behind do not outlive the episode; the last 64 KiB of its stderr
are kept for the failure reason), bounded by ``rollout.agent.timeout_s``, and returns the
proxy's recording as the episode's trajectory. An
agent that raises, exits non-zero, hangs past its timeout or is cancelled with its group fails
the episode with the reason (replayed, then replaced, like any failed episode); the proxy then
refuses its key, so an abandoned agent cannot touch a later episode.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib
import inspect
import json
import os
import shlex
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

from trainer.rollout.env_manager import EnvManager, EnvSession, Sampling, in_daemon_thread
from trainer.rollout.env_output import checked_reset, score_episode
from trainer.rollout.trajectory import Trajectory

if TYPE_CHECKING:
    from trainer.config_rollout import AgentConfig
    from trainer.rollout.proxy import AgentProxy
    from trainer.rollout.proxy_episode import ProxyEpisode

__all__ = [
    "AgentEpisode",
    "AgentRunner",
    "EnvHandle",
    "EpisodeEnded",
    "StderrTail",
    "StepResult",
    "load_agent",
]

AgentFn = Callable[["AgentEpisode"], Any]


class EpisodeEnded(RuntimeError):
    """The proxy refused a call: the episode has ended (or the key is not an episode's)."""


@dataclass(frozen=True)
class StepResult:
    """The env's answer to one action."""

    messages: list[dict[str, Any]]
    """The env's reply (its ``role: tool`` messages carry the ids of the calls they answer)."""
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


def loopback_http() -> Any:
    """An ``httpx.Client`` for the proxy: plain HTTP on loopback, so no TLS context is built
    (that costs ~20 ms per client, more than a call) and no ``HTTP_PROXY`` from the environment
    is used (``trust_env=False``: an HTTP proxy cannot reach this host's loopback); one per
    episode, never shared between agent threads."""
    import httpx

    return httpx.Client(verify=False, trust_env=False, timeout=httpx.Timeout(600.0, connect=30.0))


class EnvHandle:
    """The episode's env, over the proxy's ``/v1/envhub/step`` route (the same for a function
    and a program agent)."""

    def __init__(self, base_url: str, api_key: str) -> None:
        self._url = f"{base_url.rstrip('/')}/envhub/step"
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._http = loopback_http()

    def step(self, action: Any) -> StepResult:
        """Act: text, or an assistant message (a dict, or the ``openai`` SDK's message object)
        whose ``tool_calls`` reach the env in envhub's ``<tool_call>`` form."""
        if hasattr(action, "model_dump"):
            action = action.model_dump(exclude_none=True)
        response = self._http.post(self._url, json={"action": action}, headers=self._headers)
        data = _answer(response)
        return StepResult(
            list(data["messages"]),
            float(data["reward"]),
            bool(data["terminated"]),
            bool(data["truncated"]),
            dict(data["info"]),
        )

    def close(self) -> None:
        self._http.close()


def _answer(response: Any) -> dict[str, Any]:
    if response.status_code in (401, 410):
        raise EpisodeEnded(_message(response))
    if response.status_code >= 400:
        raise RuntimeError(f"the agent proxy answered {response.status_code}: {_message(response)}")
    return dict(response.json())


def _message(response: Any) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return str(response.text)[:500]


@dataclass
class AgentEpisode:
    """What an agent gets for one episode (see the module docstring)."""

    base_url: str
    """The proxy's OpenAI base URL (``http://127.0.0.1:PORT/v1``)."""
    api_key: str
    """Names this episode; the proxy refuses it once the episode has ended."""
    model: str
    env_id: str
    seed: int
    messages: list[dict[str, Any]]
    """The env's first observation as chat messages."""
    tools: list[dict[str, Any]] | None
    """The env's tool schemas (OpenAI function format), or None."""
    info: dict[str, Any] = field(default_factory=dict)
    """The env's reset info."""
    _env: EnvHandle | None = field(default=None, repr=False)
    _http: list[Any] = field(default_factory=list, repr=False)
    """The HTTP clients ``openai_client`` built (closed with the episode)."""

    @property
    def env(self) -> EnvHandle:
        """The env handle (``step(action)``)."""
        if self._env is None:
            self._env = EnvHandle(self.base_url, self.api_key)
        return self._env

    def openai_client(self, **kwargs: Any) -> Any:
        """An ``openai.OpenAI`` client for this episode (``kwargs`` go to the client), over a
        loopback HTTP client (``loopback_http``, closed with the episode) unless
        ``http_client`` is given."""
        import openai

        if "http_client" not in kwargs:
            kwargs["http_client"] = loopback_http()
            self._http.append(kwargs["http_client"])
        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)

    def close(self) -> None:
        """Close the connections of the env handle and of the clients ``openai_client`` built
        (the trainer does, when the episode ends: the SDK's clients hold reference cycles, so
        garbage collection alone leaves their connections open for a while)."""
        if self._env is not None:
            self._env.close()
        http, self._http = self._http, []
        for client in http:
            client.close()

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> AgentEpisode:
        """The episode of a program agent, from the variables the trainer set for it."""
        environ = os.environ if environ is None else environ
        missing = [k for k in ("OPENAI_BASE_URL", "OPENAI_API_KEY") if not environ.get(k)]
        if missing:
            raise RuntimeError(
                f"{', '.join(missing)} not set: AgentEpisode.from_environ() reads the episode of "
                "an agent that envhub train runs (rollout.agent.command)"
            )
        base_url, api_key = environ["OPENAI_BASE_URL"], environ["OPENAI_API_KEY"]
        with loopback_http() as http:
            data = _answer(
                http.get(
                    f"{base_url.rstrip('/')}/envhub/episode",
                    headers={"Authorization": f"Bearer {api_key}"},
                )
            )
        return cls(
            base_url,
            api_key,
            str(data["model"]),
            str(data["env_id"]),
            int(data["seed"]),
            list(data["messages"]),
            data["tools"],
            dict(data["info"]),
        )


def load_agent(spec: str) -> AgentFn:
    """The function ``"package.module:function"`` names, importable from the working directory
    as well (as ``uvicorn app:app`` is); a clear error if it cannot load."""
    module_name, _, name = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - the user's module may fail any way
        raise ValueError(
            f"rollout.agent.callable: cannot import {module_name!r} "
            f"({type(error).__name__}: {error}); is its package installed or on PYTHONPATH?"
        ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(  # noqa: TRY004 - a configuration error, like the import above
            f"rollout.agent.callable: {module_name!r} has no function {name!r}"
            + (f" ({name} is a {type(fn).__name__})" if fn is not None else "")
        )
    return fn


class AgentRunner(EnvManager):
    """Plays each episode with the agent through ``proxy`` (see the module docstring); to the
    scheduler it is an ``EnvManager`` (``run``, ``close_session``, ``engine``)."""

    def __init__(
        self,
        proxy: AgentProxy,
        agent: AgentConfig,
        *,
        on_episode_end: Callable[[Trajectory], Any] | None = None,
        step_timeout_s: float | None = None,
    ) -> None:
        super().__init__(
            proxy.engine,
            proxy.renderer,
            max_turns=proxy.max_turns,
            max_context_tokens=proxy.max_context_tokens,
            on_episode_end=on_episode_end,
            step_timeout_s=step_timeout_s,
            sample_unit="episode",  # the proxy decides per call (module docstring of proxy)
        )
        self.proxy, self.agent = proxy, agent
        self.fn = load_agent(agent.callable) if agent.callable else None
        if self.fn is not None:  # its own clients (openai.AsyncOpenAI...) read this process's
            os.environ.update(_no_proxy(proxy.base_url, os.environ))  # (loopback only added)
        command = agent.command or []
        self.command = shlex.split(command) if isinstance(command, str) else list(command)

    async def run(
        self,
        session: EnvSession,
        env_id: str,
        seed: int,
        sampling: Sampling,
        group_id: int = 0,
        *,
        episode_key: str | None = None,
    ) -> Trajectory:
        """One episode played by the agent, scored by ``on_episode_end``; never raises for what
        the agent, the env or the reward function does (the episode fails, naming it)."""
        trajectory = Trajectory(env_id=env_id, seed=seed, group_id=group_id)
        try:
            # as the built-in loop resets (tools listed once where the template renders them):
            # the agent gets them as info["tools"], to send as the request's tools=
            reset = session.reset(seed, self.proxy.renderer.reset_options)
            messages, info = checked_reset(await self._env_call(reset), env_id)
        except Exception as error:  # noqa: BLE001 - env code may raise any exception
            return self._failed(trajectory, "reset", error)
        trajectory.info = dict(info)
        trajectory.messages.extend(messages)
        key = episode_key or f"agent-{id(trajectory)}"
        episode = self.proxy.open(key, trajectory, session, sampling, list(messages), info)
        view = AgentEpisode(
            self.proxy.base_url,
            episode.api_key,
            self.proxy.model_name,
            env_id,
            seed,
            list(messages),
            episode.tools,
            json.loads(json.dumps(trajectory.info, default=repr)),
        )
        try:
            await self._play(episode, view)
        finally:
            self.proxy.close(episode)
            forget = getattr(self.engine, "forget", None)
            if episode_key is None and forget is not None:  # (a caller's key is its to forget)
                forget(key)
        trajectory = episode.finish()
        if not (trajectory.terminated or trajectory.truncated or trajectory.failed):
            trajectory.truncated = True  # the agent stopped before the env ended the episode
        return await score_episode(trajectory, self.on_episode_end)

    async def _play(self, episode: ProxyEpisode, view: AgentEpisode) -> None:
        """Run the agent until it returns, fails, times out or the proxy ends the episode."""
        agent = asyncio.ensure_future(self._agent(view))
        ended = asyncio.ensure_future(episode.ended.wait())
        try:
            done, _ = await asyncio.wait(
                {agent, ended}, timeout=self.agent.timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if episode.ended.is_set():  # the proxy ended it: truncated, aborted or failed
                return
            if agent in done:
                error = agent.exception()
                if error is not None:
                    episode.end(f"agent raised {type(error).__name__}: {error}")
                    return
                answer = agent.result()
                if isinstance(answer, str) and not episode.env_done:
                    await self._final_answer(episode, answer)
                elif answer is not None and not isinstance(answer, str):
                    episode.end(
                        f"the agent returned a {type(answer).__name__}; return None (it stepped "
                        "the env) or its final answer as a string"
                    )
            elif not done:
                episode.end(
                    f"agent timeout: no return within {self.agent.timeout_s} s "
                    "(rollout.agent.timeout_s)"
                )
        finally:
            for task in (agent, ended):
                task.cancel()  # a thread agent is abandoned; a program is killed
            await asyncio.gather(agent, ended, return_exceptions=True)
            view.close()

    async def _final_answer(self, episode: ProxyEpisode, answer: str) -> None:
        from trainer.rollout.proxy_http import ProxyError

        try:
            await self.proxy.step(episode, answer)
        except ProxyError as error:
            if not episode.trajectory.failed:
                episode.end(f"the final answer could not be played: {error.message}")

    async def _agent(self, view: AgentEpisode) -> Any:
        if self.fn is not None:
            return await in_daemon_thread(_run_agent, self.fn, view)
        return await self._program(view)

    async def _program(self, view: AgentEpisode) -> None:
        """The agent program, in its own session: when it exits or is cancelled, its process
        group is killed (a helper it left running, holding its stderr, is not waited for),
        and of its stderr only the tail is kept (``StderrTail``).

        The trainer's interpreter directory leads its ``PATH``: ``python my_agent.py`` runs on the
        interpreter that has envhub and the agent's SDK (a venv need not be activated), as
        ``uv run`` and tox do; a full path still picks another one."""
        env = {
            **os.environ,
            "PATH": os.pathsep.join(
                filter(None, [os.path.dirname(sys.executable), os.environ.get("PATH")])
            ),
            **_no_proxy(view.base_url, os.environ),
            "OPENAI_BASE_URL": view.base_url,
            "OPENAI_API_KEY": view.api_key,
            "ENVHUB_AGENT_MODEL": view.model,
        }
        loop = asyncio.get_running_loop()
        try:
            transport, protocol = await loop.subprocess_exec(
                lambda: _ExitProtocol(loop),
                *self.command,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as error:
            raise RuntimeError(f"rollout.agent.command {self.command} cannot start: {error}")
        tail = StderrTail()
        reading = asyncio.ensure_future(tail.read(cast(asyncio.StreamReader, protocol.stderr)))
        try:
            await asyncio.shield(protocol.exited)  # not wait(): that waits for stderr's EOF
        finally:  # exited, or cancelled: what it left running goes with it (its session)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(transport.get_pid(), signal.SIGKILL)
            if transport.get_returncode() is None:  # it left its process group
                with contextlib.suppress(ProcessLookupError):
                    transport.kill()
            await protocol.exited
            # the pipe closes once its holders are dead; one that escaped is not waited for
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(reading), 0.5)
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            transport.close()
        status = transport.get_returncode()
        if status != 0:
            raise RuntimeError(f"exited with status {status}: {tail.last_lines()}")


def _run_agent(fn: AgentFn, view: AgentEpisode) -> Any:
    """``fn(view)`` in the agent's thread; an ``async def`` agent's coroutine runs to its end
    on an event loop of its own there (``asyncio.run``), never on the rollout loop."""
    result = fn(view)
    if inspect.iscoroutine(result):
        return asyncio.run(result)
    if inspect.isawaitable(result):  # an awaitable that is not a coroutine (a Future-like)
        return asyncio.run(_awaited(result))
    return result


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _no_proxy(base_url: str, environ: Mapping[str, str]) -> dict[str, str]:
    """``NO_PROXY`` and ``no_proxy`` with the proxy's host (and loopback) added, so a program
    agent's own HTTP clients, which read ``HTTP_PROXY`` from the environment they inherit,
    reach the proxy directly: an HTTP proxy cannot reach this host's loopback."""
    hosts = ["127.0.0.1", "localhost", urlsplit(base_url).hostname or ""]
    out = {}
    for name in ("NO_PROXY", "no_proxy"):
        listed = [h.strip() for h in environ.get(name, "").split(",") if h.strip()]
        out[name] = ",".join(dict.fromkeys([*listed, *filter(None, hosts)]))
    return out


class _ExitProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """asyncio's protocol for a subprocess with streams, saying when the process exits
    (``exited``), before the pipes its children may still hold are closed."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=2**16, loop=loop)
        self.exited: asyncio.Future[None] = loop.create_future()

    def process_exited(self) -> None:
        super().process_exited()
        if not self.exited.done():
            self.exited.set_result(None)


class StderrTail:
    """The last ``limit`` bytes an agent program wrote to stderr (for the reason it failed):
    however much it logs, the trainer holds no more."""

    def __init__(self, limit: int = 64 * 1024) -> None:
        self.limit = limit
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0

    async def read(self, stream: asyncio.StreamReader) -> None:
        """Keep the tail of ``stream`` until its end."""
        while chunk := await stream.read(65536):
            self._chunks.append(chunk)
            self._size += len(chunk)
            while self._size - len(self._chunks[0]) >= self.limit:
                self._size -= len(self._chunks.popleft())

    def last_lines(self, lines: int = 3, chars: int = 300) -> str:
        """The last ``lines`` non-empty lines, ``|``-joined, their last ``chars`` characters."""
        text = b"".join(self._chunks)[-self.limit :].decode(errors="replace")
        joined = " | ".join([line for line in text.splitlines() if line.strip()][-lines:])
        return joined if len(joined) <= chars else "..." + joined[-chars:]
