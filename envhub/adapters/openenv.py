"""OpenEnv env servers as envhub envs: ``openenv/remote-v0``, ``openenv/local-v0``, and one id
per installed OpenEnv env package.

OpenEnv environments are servers (FastAPI apps speaking OpenEnv's HTTP/WebSocket protocol);
this adapter plays one through OpenEnv's own client library (``openenv-core``'s
``GenericEnvClient``, its WebSocket session):

- ``openenv/remote-v0`` with ``base_url="http://host:port"``: a server already running;
- ``openenv/local-v0`` with ``app="module:attr"``: the adapter starts the app in a child
  process on a loopback port (``envhub.adapters.local_server``), starts it again at the next
  reset if it died, and stops it at ``close()`` (it dies with its owner process, even one
  killed by SIGKILL);
- ``openenv/<key>-v0``: every installed OpenEnv env package (``openenv-<key>_env``, as
  OpenEnv's own discovery finds them; its ``openenv.yaml`` names the app), run locally.

The model's text becomes the action: ``{action_field: text}`` when the server's action schema
(``GET /schema``) has one required string field, or ``action_field=`` says which; otherwise
the text must be a JSON object of the action's fields (a malformed one is an invalid action
with the schema as feedback). The observation becomes text: its ``messages`` if it carries
chat messages, else ``observation_field``, else its only string field, else its JSON. The
server's reward (``None`` is 0) and ``done`` (terminated) pass through.

``messages``, new or history: some servers send only the new messages each step, others
(OpenEnv's own chat_env) the whole conversation so far. A step returns what is new either way
(``TextEnv`` guarantee 2: the transcript holds each message once): when a step's ``messages``
extends the list the server sent last (is longer and starts with all of it), it is a
history, and the step returns what
follows the last ``assistant`` message in the added part (the server's echo of the agent's
own turn is in the transcript already); any other list is taken as new messages. A reset
returns its ``messages`` whole.

Success: OpenEnv's protocol has no success signal (a step answers observation, reward and
done; ``serialize_observation`` strips the env's metadata), so an episode is a success when
it ends with a reward of at least ``success_threshold``: 1.0 by default, a full reward, as
``success`` means for envhub's other sources. OpenEnv's own harness
(``CollectRunner.success_rate``) counts any positive final reward instead; for that
convention, pass ``success_threshold=1e-9`` (an env that pays partial credit, say 0.1 for a
wrong but well-formed answer, then counts every answer a success).

Determinism: each reset sends a seed drawn from the env's RNG; OpenEnv servers pass it to
their env's ``reset`` only if that ``reset`` takes a ``seed`` (OpenEnv drops the arguments an
env does not declare), so episodes are reproducible exactly when the server's env is.

Errors: a server that cannot be reached, or that does not speak the protocol openenv-core
0.3 speaks (no ``GET /schema``, no ``/ws`` route, answers of another shape: not JSON, a
reward that is not a finite number or null, a ``done`` that is not true or false), raises
``SourceConnectionError`` naming the URL and what was missing. ``connect_timeout_s`` bounds
the whole ``GET /schema`` answer (at most 4 MiB); ``message_timeout_s`` bounds each answer on
the session. After a connection-level error (the server closed the session, died, or did not
answer in time) the adapter closes its client, and the next reset opens a new session; a
session the server closed between episodes (envhub's hub reaps idle ones) is reopened by the
reset without an error.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import importlib.metadata
import importlib.util
import json
import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from envhub.adapters import SOURCES, installed, require
from envhub.adapters.local_server import LocalServer
from envhub.core import Message, TextEnv, Turn
from envhub.errors import SourceConfigError, SourceConnectionError, SourceError
from envhub.registry import note_namespace
from envhub.registry import register as register_env

__all__ = ["OpenEnvEnv", "discover", "register"]

SOURCE = "openenv"
_PROTOCOL = "the OpenEnv protocol of openenv-core 0.3 (GET /schema, WebSocket /ws)"
_SCHEMA_LIMIT_BYTES = 4 * 2**20


class OpenEnvEnv(TextEnv):
    """One OpenEnv env server, played through OpenEnv's client (module docstring)."""

    def __init__(
        self,
        *,
        base_url: str | None = None,
        app: str | None = None,
        action_field: str | None = None,
        observation_field: str | None = None,
        connect_timeout_s: float = 10.0,
        message_timeout_s: float = 60.0,
        start_timeout_s: float = 120.0,
        success_threshold: float = 1.0,
        max_turns: int | None = 50,
        render_mode: Any = None,
    ) -> None:
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        if (base_url is None) == (app is None):
            raise SourceConfigError(
                "an OpenEnv env needs exactly one of base_url='http://host:port' (a running "
                "server) or app='module:attr' (an OpenEnv app envhub starts locally)"
            )
        if not isinstance(success_threshold, (int, float)) or not math.isfinite(success_threshold):
            raise SourceConfigError(
                f"success_threshold={success_threshold!r}: give a finite number, the final reward "
                "at or above which an episode is a success (1.0 for a full reward, 1e-9 for any "
                "positive one, as OpenEnv's own harness counts)"
            )
        require(SOURCE)
        self.base_url, self.app = base_url, app
        self.action_field, self.observation_field = action_field, observation_field
        self.connect_timeout_s, self.message_timeout_s = connect_timeout_s, message_timeout_s
        self.start_timeout_s = start_timeout_s
        self.success_threshold = float(success_threshold)
        self._server: LocalServer | None = None
        self._client: Any = None
        self._schema: dict[str, Any] = {}
        self._sent: list[Message] = []
        """The ``messages`` the server sent last (to tell a history from new messages)."""

    # ----------------------------------------------------------------- TextEnv
    def on_reset(self, options: dict[str, Any]) -> tuple[str | list[Message], dict[str, Any]]:
        seed = int(self.np_random.integers(2**31))
        reused = self._client is not None
        try:
            result = self._reset(seed)
        except _SessionClosed:
            if not reused:
                raise
            # the server closed the session since the last episode: once more, on a new one
            result = self._reset(seed)
        observation = self._render(result.observation, reset=True)
        return observation, {"openenv": self.app or _redacted(self._url())}

    def on_step(self, action: str) -> Turn:
        try:
            payload = self._action(action)
        except _BadAction as error:
            return self.invalid_action(str(error))
        if self._client is None:
            raise SourceConnectionError(
                f"the connection to the OpenEnv server at {_redacted(self._url())} was lost "
                "earlier in this episode; call env.reset() to start a new one"
            )
        try:
            result = self._call(self._client.step, payload)
        except _ValidationError as error:
            return self.invalid_action(f"The server refused that action: {error}")
        reward = 0.0 if result.reward is None else float(result.reward)
        done = result.done
        return Turn(
            self._render(result.observation, reset=False),
            reward=reward,
            terminated=done,
            success=done and reward >= self.success_threshold,
        )

    def sample_action(self, np_random: np.random.Generator) -> str:
        words = ("hello", "up", "42", "print(1)", "[0]", "yes")
        return " ".join(str(np_random.choice(words)) for _ in range(int(np_random.integers(1, 4))))

    def on_close(self) -> None:
        self._drop_client()
        if self._server is not None:
            self._server.stop()
            self._server = None

    def __getstate__(self) -> dict[str, Any]:
        # a copy opens its own connection (and starts its own local server) at reset
        return {**self.__dict__, "_client": None, "_server": None}

    # ----------------------------------------------------------------- connection
    def _url(self) -> str:
        """The server's URL, credentials included (only ever shown through ``_redacted``)."""
        return self._server.url if self._server is not None else str(self.base_url)

    def _connect(self) -> Any:
        if self.app is not None and (self._server is None or not self._server.running):
            self._drop_client()  # a local server that died (or never ran) is started anew
            if self._server is not None:
                self._server.stop()
            self._server = LocalServer(self.app, start_timeout_s=self.start_timeout_s)
            self._server.start()
        if self._client is not None:
            return self._client
        url = self._url().rstrip("/")
        self._schema = _schema(url, self.connect_timeout_s, local=self._server)
        if self.action_field is None:
            self.action_field = _only_string_field(self._schema.get("action", {}))
        generic = require(SOURCE, "openenv.core.generic_client").GenericEnvClient
        client = generic(
            base_url=url,
            connect_timeout_s=self.connect_timeout_s,
            message_timeout_s=self.message_timeout_s,
        ).sync()
        try:
            client.connect()
        except ConnectionError as error:
            client.close()
            raise SourceConnectionError(
                f"the server at {_redacted(url)} answers GET /schema but refused a WebSocket "
                f"session at /ws ({error}); it does not speak {_PROTOCOL} (another OpenEnv "
                "version?)"
            ) from error
        self._client = client
        return client

    def _drop_client(self) -> None:
        """Close the client (its thread, its socket, the server's session) and forget it."""
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):  # the server may be gone already
                client.close()

    def _reset(self, seed: int) -> Any:
        client = self._connect()
        try:
            return self._call(client.reset, seed=seed)
        except SourceError:
            # no episode to keep the session for (a hub at capacity refuses, then closes)
            self._drop_client()
            raise

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """``method`` of the client with its answer checked; after a connection-level error
        or an answer out of step, the client is closed and the next reset opens a new one."""
        url, what = _redacted(self._url()), f"a {getattr(method, '__name__', 'message')}"
        closed = require(SOURCE, "websockets.exceptions").ConnectionClosed
        try:
            result = method(*args, **kwargs)
        except closed as error:
            self._drop_client()
            raise _SessionClosed(
                f"the OpenEnv server at {url} closed the connection during {what} ({error}); "
                "the next reset opens a new session"
            ) from error
        except TimeoutError as error:
            self._drop_client()
            raise SourceConnectionError(
                f"the OpenEnv server at {url} did not answer {what} within "
                f"message_timeout_s={self.message_timeout_s}; is the server stuck? (raise "
                "message_timeout_s for an env that is slow on purpose)"
            ) from error
        except RuntimeError as error:  # the client's rendering of an ``error`` message
            if "VALIDATION_ERROR" in str(error):
                raise _ValidationError(str(error)) from error
            raise SourceError(f"the OpenEnv server at {url} failed: {error}") from error
        except (ConnectionError, OSError) as error:
            self._drop_client()
            raise SourceConnectionError(
                f"lost the OpenEnv server at {url} ({type(error).__name__}: {error})"
            ) from error
        # not JSON (ValueError), or JSON of another shape (the client's .get on a list)
        except (ValueError, AttributeError, TypeError) as error:
            self._drop_client()
            raise SourceConnectionError(
                f"the server at {url} answered {what} with something that is not an OpenEnv "
                f"answer ({type(error).__name__}: {error}); it does not speak {_PROTOCOL}"
            ) from error
        problem = _answer_problem(result)
        if problem:
            raise SourceConnectionError(
                f"the server at {url} answered {what} with {problem}; it does not speak {_PROTOCOL}"
            )
        return result

    # ----------------------------------------------------------------- text <-> OpenEnv
    def _action(self, text: str) -> dict[str, Any]:
        if self.action_field is not None:
            return {self.action_field: text}
        try:
            payload = json.loads(text)
        except (ValueError, RecursionError, MemoryError):  # not JSON, or nested too deeply
            payload = None
        if not isinstance(payload, dict):
            raise _BadAction(
                "Write the action as one JSON object with the fields of this schema: "
                + json.dumps(self._schema.get("action", {}).get("properties", {}))
            )
        return payload

    def _render(self, observation: dict[str, Any], *, reset: bool) -> str | list[Message]:
        """The observation as this turn's new messages or text (module docstring)."""
        messages = observation.get("messages")
        previous, self._sent = self._sent, []
        if (
            isinstance(messages, list)
            and messages
            and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)
        ):
            sent: list[Message] = [
                {"role": str(m.get("role", "user")), "content": m["content"]} for m in messages
            ]
            self._sent = sent
            return sent if reset else _new_messages(previous, sent)
        if self.observation_field is not None:
            return str(observation.get(self.observation_field, ""))
        strings = [value for value in observation.values() if isinstance(value, str)]
        if len(strings) == 1:
            return strings[0] or "(empty)"
        return json.dumps(observation, sort_keys=True, default=str)


def _new_messages(previous: list[Message], sent: list[Message]) -> list[Message]:
    """What ``sent`` adds to the conversation: all of it, unless it extends ``previous`` (a
    history), then what follows the last ``assistant`` message of the part it adds."""
    if not previous or len(sent) <= len(previous) or sent[: len(previous)] != previous:
        return sent
    added = sent[len(previous) :]
    last = max((i for i, m in enumerate(added) if m["role"] == "assistant"), default=-1)
    return added[last + 1 :]


def _answer_problem(result: Any) -> str:
    """What makes ``result`` (a parsed answer) not an OpenEnv answer, or ``""``."""
    if not isinstance(getattr(result, "observation", None), dict):
        return "no observation object"
    reward = result.reward
    if reward is not None and (
        not isinstance(reward, (int, float))
        or isinstance(reward, bool)
        or not math.isfinite(reward)
    ):
        return f"reward={reward!r}, not a finite number or null"
    if not isinstance(result.done, bool):
        return f"done={result.done!r}, not true or false"
    return ""


class _SessionClosed(SourceConnectionError):
    """The server closed the WebSocket session (it died, or reaped or refused the session)."""


class _ValidationError(Exception):
    """The server refused an action as invalid for its schema (the model's mistake)."""


class _BadAction(Exception):
    """The model's text is not an action this server takes (the feedback is the message)."""


def _redacted(url: str) -> str:
    """``url`` with any password in it replaced by ``***`` (for messages)."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _schema(url: str, timeout_s: float, *, local: LocalServer | None = None) -> dict[str, Any]:
    """``GET /schema``: the action/observation JSON Schemas, or a ``SourceConnectionError``
    (naming the ``local`` server envhub started, with its last output, when there is one).

    Credentials in the URL (``http://user:TOKEN@host``) go as HTTP Basic auth, as OpenEnv's
    WebSocket client sends them.
    """
    parts = urllib.parse.urlsplit(url)
    headers = {}
    if parts.username is not None or parts.password is not None:
        credentials = f"{parts.username or ''}:{parts.password or ''}".encode()
        headers["Authorization"] = "Basic " + base64.b64encode(credentials).decode()
        netloc = str(parts.hostname) + (f":{parts.port}" if parts.port else "")
        url = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    shown = _redacted(urllib.parse.urlunsplit(parts))
    request = urllib.request.Request(f"{url}/schema", headers=headers)
    deadline = time.monotonic() + timeout_s
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = json.loads(_read_schema(response, shown, timeout_s, deadline))
    except SourceConnectionError:
        raise
    except urllib.error.HTTPError as error:
        raise SourceConnectionError(
            f"the server at {shown} answered GET /schema with HTTP {error.code}; it does not speak "
            f"{_PROTOCOL} (another OpenEnv version, or not an OpenEnv server)"
        ) from error
    except TimeoutError as error:
        raise SourceConnectionError(
            f"the server at {shown} did not answer GET /schema within "
            f"connect_timeout_s={timeout_s}; is it running, and an OpenEnv server?"
        ) from error
    except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
        reason = getattr(error, "reason", error)
        if local is not None:
            raise SourceConnectionError(
                f"the local OpenEnv server {local.app!r} envhub started at {shown} does not "
                f"answer ({reason}; exit code {local.exit_code}); the next reset starts it "
                f"again. Its last output:\n{local.output}"
            ) from error
        raise SourceConnectionError(
            f"cannot reach the OpenEnv server at {shown} ({reason}); is it running? (check "
            "base_url)"
        ) from error
    except ValueError as error:
        raise SourceConnectionError(
            f"the server at {shown} answered GET /schema with something that is not JSON; it does "
            f"not speak {_PROTOCOL}"
        ) from error
    if not isinstance(body, dict) or not isinstance(body.get("action"), dict):
        raise SourceConnectionError(
            f"the server at {shown} answered GET /schema without an action schema; it does not "
            f"speak {_PROTOCOL}"
        )
    return body


def _read_schema(response: Any, shown: str, timeout_s: float, deadline: float) -> bytes:
    """The body of ``response``, read by ``deadline`` (each read waits at most ``timeout_s``)
    and at most ``_SCHEMA_LIMIT_BYTES`` long, or a ``SourceConnectionError``."""
    chunks: list[bytes] = []
    size = 0
    while chunk := response.read1(65536):
        chunks.append(chunk)
        size += len(chunk)
        if size > _SCHEMA_LIMIT_BYTES:
            raise SourceConnectionError(
                f"the server at {shown} answered GET /schema with more than "
                f"{_SCHEMA_LIMIT_BYTES >> 20} MiB; an OpenEnv schema is a few KiB (is base_url "
                "an OpenEnv server?)"
            )
        if time.monotonic() > deadline:
            raise SourceConnectionError(
                f"the server at {shown} did not finish its answer to GET /schema within "
                f"connect_timeout_s={timeout_s}; is it an OpenEnv server, and not overloaded?"
            )
    return b"".join(chunks)


def _only_string_field(schema: dict[str, Any]) -> str | None:
    """The action's field to put the text in: its only required string property, if one."""
    properties = schema.get("properties", {})
    required = [name for name in schema.get("required", []) if name in properties]
    strings = [name for name in required if properties[name].get("type") == "string"]
    return strings[0] if len(strings) == 1 and len(required) == 1 else None


def discover() -> dict[str, str]:
    """Installed OpenEnv env packages as ``{key: "module.server.app:app"}``.

    The same rule as OpenEnv's own discovery: distributions named ``openenv-<name>`` (not
    ``openenv-core``) with an importable package; the key is the name without its ``_env``
    suffix. The app is where the package's ``openenv.yaml`` says (``app:``), else OpenEnv's
    convention ``<package>.server.app:app``.
    """
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = str(dist.metadata["Name"] or "")
        if not name.startswith("openenv-") or name == "openenv-core":
            continue
        module = name.removeprefix("openenv-").replace("-", "_")
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            continue
        manifest = Path(next(iter(spec.submodule_search_locations))) / "openenv.yaml"
        try:
            app = re.search(r"^app:\s*(\S+)\s*$", manifest.read_text(), re.MULTILINE)
        except OSError:
            app = None
        key = re.sub(r"[-_]env$", "", module).replace("_", "-")
        found[key] = f"{module}.{app[1] if app else 'server.app:app'}"
    return found


def register() -> None:
    """The ``envhub.envs`` entry point: the generic ids and one per installed OpenEnv env."""
    if not installed(SOURCE):
        note_namespace(SOURCE, SOURCES[SOURCE].missing_note)
        return
    entry = "envhub.adapters.openenv:OpenEnvEnv"
    register_env(
        "openenv/remote-v0",
        entry,
        max_turns=50,
        description="Any running OpenEnv server: base_url='http://host:port'.",
    )
    register_env(
        "openenv/local-v0",
        entry,
        max_turns=50,
        description="An OpenEnv app started locally: app='module:attr'.",
    )
    for key, app in sorted(discover().items()):
        register_env(
            f"openenv/{key}-v0",
            entry,
            kwargs={"app": app},
            max_turns=50,
            description=f"The installed OpenEnv env {app}, run locally.",
        )
