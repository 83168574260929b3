"""``RemoteEnv``: a ``gymnasium.Env`` whose episodes run on an envhub hub.

``envhub.make("games/sokoban-v0", hub="ws://host:8000", token=...)`` returns one. It
behaves like the local env: same observations, rewards and info; ``step`` before
``reset`` raises ``ResetNeededError`` and ``step`` after the end ``EpisodeOverError``. It
reads like a ``TextEnv`` too: ``tools`` (from reset info, so ``[]`` until the first reset),
``done``, ``turn`` and ``messages`` (the transcript, kept by the client). ``expert_action``
is not offered: the protocol carries no such request, and a ``None`` would wrongly say the
env has no expert; play the expert on a local env (``envhub.make(id)``).

Env kwargs cannot travel: the hub builds its envs when it starts, so ``make(id, hub=...,
size=8)`` raises ``EnvKwargsError`` naming the fix, ``envhub serve --env ID -k size=8``
(or a variant id registered with those kwargs). ``render_mode`` is the client's own
(``"ansi"``/``"human"``): ``render()`` renders the transcript kept here, as ``TextEnv.render``
does. ``spec`` is a Gymnasium spec of the id whose ``gymnasium.make`` opens a new RemoteEnv on
the same hub (the token comes from ``$ENVHUB_TOKEN``: a spec carries no secret). ``options``
may hold numpy numbers and arrays (sent as JSON); answers of the wrong types are refused
(``envhub.client_session``, which also speaks the protocol).

Dropped sockets
---------------
Each request carries a sequence number. When the socket drops (a proxy timeout during a
long generation, a network blip), the client reconnects with its session's resume key and
resends the unanswered request; the hub answers it from its record if it was already
applied, so no step is lost or applied twice. Reconnection is retried with backoff until
``resume_timeout_s`` (default: the hub's grace period; each attempt's handshake and welcome
wait within it), then ``SessionLostError`` with code ``resume_timeout``. A request whose
link drops every time it is sent is given up after a few resumes (``SessionLostError``,
code ``connection_unstable``).

Waiting for an answer
---------------------
``request_timeout_s`` (default 300 s: above what a hub at its defaults takes to answer or
fail any request, ``reset_wait_s`` + ``step_timeout_s`` = 90 s) bounds the wait for each
answer. A hub that stays connected but does not answer in time is reconnected to once and
the request resent; a second silence raises ``RemoteError`` with code ``request_timeout``.
Raise it for a hub served with a longer ``--step-timeout``. The hub may still be running the
request given up on: the episode's state is unknown here, so ``step`` raises
``ResetNeededError``, and ``reset`` first awaits that request's answer (resending its ``seq``:
the hub answers it once it ends and applies nothing twice), within the same bound, before it
starts the new episode; while the old request runs, ``reset`` raises ``request_timeout``
saying so, and a later ``reset`` works.

Sessions that are gone
----------------------
The hub closes a session that sent nothing for its ``idle_timeout_s`` (``--idle-timeout``),
forgets one whose link stayed down past ``grace_s``, and loses all of them when it restarts.
``step`` then raises ``SessionLostError`` (code ``idle_timeout``, ``unknown_session`` or
``draining``) naming the cause; ``reset`` opens a new session for the same id (it starts a new
episode anyway, so nothing is lost) and counts it in ``reconnects``.

Errors that are not retried
---------------------------
A message over a size limit raises ``RemoteError`` with code ``message_too_large`` and the
limit to raise: an action over the hub's ``max_message_bytes`` (its welcome states it) is
refused before it is sent; an answer over this client's ``max_message_bytes`` (the
constructor's option) is refused when it arrives. A reply that is not the hub's protocol
(a wrong URL, a proxy's error page, another envhub version) raises code ``bad_message``.
Either way the session goes on: the next call may succeed.

Failed episodes
---------------
If the hub's worker crashed or hung, ``step`` returns ``([], 0.0, False, True, info)`` with
``info["episode_failed"] = True`` and ``info["failure"]`` (reason, detail): the episode is
over, as data a trainer can filter, and a further ``step`` raises ``EpisodeOverError``; call
``reset`` to go on. A failed ``reset`` raises ``RemoteError`` with code ``episode_failed``.
"""

from __future__ import annotations

import os
from typing import Any

import gymnasium as gym

from envhub.client_session import HubSession
from envhub.core import (
    ChatSpace,
    TextEnv,
    TextSpace,
    assistant_message,
    messages_to_text,
    render_transcript,
)
from envhub.errors import EnvKwargsError, EpisodeOverError, ResetNeededError
from envhub.server.config import serve_command
from envhub.server.errors import RemoteError

__all__ = ["RemoteEnv"]


class RemoteEnv(gym.Env[list[dict[str, Any]], str]):
    """A hub-hosted env behind the Gymnasium API (see the module docstring).

    Options: ``token`` (default ``$ENVHUB_TOKEN``); ``connect_timeout_s``, the time to open
    a connection and be welcomed; ``resume_timeout_s``, how long to try to resume after a
    dropped socket (default: the hub's ``grace_s``); ``request_timeout_s``, how long to wait
    for each answer before reconnecting once and then raising; ``max_message_bytes``, the
    largest answer this client accepts; ``render_mode``, ``"ansi"`` or ``"human"`` (rendered
    here, from the transcript). Any other keyword is taken for an env kwarg and refused (see
    the module docstring).
    """

    metadata = TextEnv.metadata

    def __init__(
        self,
        env_id: str,
        hub: str,
        *,
        token: str | None = None,
        connect_timeout_s: float = 30.0,
        resume_timeout_s: float | None = None,
        request_timeout_s: float = 300.0,
        max_message_bytes: int = 16 << 20,
        render_mode: str | None = None,
        **env_kwargs: Any,
    ) -> None:
        if env_kwargs:
            raise EnvKwargsError(
                f"{env_id} cannot be given env kwargs through a hub (got "
                f"{', '.join(f'{k}={v!r:.40}' for k, v in env_kwargs.items())}): the hub builds "
                f"its envs itself. Serve it with them: `{serve_command(env_id, env_kwargs)}`, or "
                "register a variant with them (envhub.register(..., variants={NAME: {...}})) and "
                "serve that id. RemoteEnv's own options are token, connect_timeout_s, "
                "resume_timeout_s, request_timeout_s, max_message_bytes and render_mode"
            )
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(
                f"render_mode={render_mode!r} is not supported; use one of "
                f"{self.metadata['render_modes']} or None (a RemoteEnv renders its transcript)"
            )
        super().__init__()
        base = hub.rstrip("/")
        if base.startswith(("http://", "https://")):
            base = "ws" + base[4:]
        if not base.startswith(("ws://", "wss://")):
            raise ValueError(
                f"hub must be a ws:// or wss:// address like 'ws://127.0.0.1:8000', got {hub!r}"
            )
        self.env_id = env_id
        self.render_mode = render_mode
        self.spec = _gym_spec(env_id, hub)
        self.observation_space = ChatSpace()
        self.action_space = TextSpace()
        self.episode: int | None = None
        self._turn = 0
        self._done = False
        self._end_reason = ""
        self._history: list[dict[str, Any]] = []
        self._tools: list[dict[str, Any]] = []
        self._link = HubSession(
            env_id,
            f"{base}/v1/session",
            hub,
            token=token if token is not None else os.environ.get("ENVHUB_TOKEN"),
            connect_timeout_s=connect_timeout_s,
            resume_timeout_s=resume_timeout_s,
            request_timeout_s=request_timeout_s,
            max_message_bytes=max_message_bytes,
        )

    # ------------------------------------------------------------------ the Gymnasium API
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        super().reset(seed=seed)
        reply = self._link.request({"type": "reset", "seed": seed, "options": options})
        if reply.type == "episode_failed":
            failure = reply.failure
            self._done, self._end_reason = True, f"its reset failed on the hub: {failure['reason']}"
            raise RemoteError(
                "episode_failed",
                (
                    f"reset failed on the hub ({failure['reason']}): {failure['detail']}; call "
                    "reset() again"
                ),
            )
        self.episode = reply.episode
        observation, info = reply.result["observation"], reply.result["info"]
        self._turn, self._done, self._end_reason = 0, False, ""
        self._history = list(observation)
        self._tools = list(info.get("tools") or [])
        return observation, info

    def step(
        self, action: str | dict[str, Any]
    ) -> tuple[list[dict[str, Any]], float, bool, bool, dict[str, Any]]:
        """Step the remote env with the model's text or an assistant message (``TextEnv.step``)."""
        self._refuse_step()
        if not isinstance(action, str):
            action = assistant_message(action, "RemoteEnv")
        reply = self._link.request({"type": "step", "action": action})
        self._history.append(
            {"role": "assistant", "content": action} if isinstance(action, str) else action
        )
        if reply.type == "episode_failed":
            failure = reply.failure
            info = {
                "turn": failure.get("turn", 0),
                "success": False,
                "invalid_action": False,
                "episode_failed": True,
                "failure": failure,
            }
            self._turn, self._done = info["turn"], True
            self._end_reason = f"it failed on the hub: {failure['reason']}"
            return [], 0.0, False, True, info
        r = reply.result
        observation, info = r["observation"], r["info"]
        terminated, truncated = r["terminated"], r["truncated"]
        self._turn = info.get("turn", self._turn + 1)
        if terminated or truncated:
            self._done, self._end_reason = True, "terminated" if terminated else "truncated"
        self._history.extend(observation)
        if self.render_mode == "human":
            print(messages_to_text(observation))
        return observation, float(r["reward"]), terminated, truncated, info

    def render(self) -> str | None:
        """``ansi``: the whole transcript as text; ``human``: print it; ``None``: nothing (as
        ``TextEnv.render``)."""
        return render_transcript(self._history, self.render_mode)

    def _refuse_step(self) -> None:
        """Raise what a local env raises for a step it cannot take, without asking the hub."""
        link = self._link
        if link.closed:
            raise RemoteError("closed", "this RemoteEnv was closed; make a new one")
        if link.unanswered is not None:
            kind = link.unanswered[2]
            raise ResetNeededError(
                f"{self.env_id} (remote): the last {kind} got no answer within "
                f"request_timeout_s={link.request_timeout_s:g} s, so this episode's state is "
                f"unknown here; call reset() (it first waits for that {kind} to end on the hub)"
            )
        if self._done:
            raise EpisodeOverError(
                f"{self.env_id} (remote): step() was called after the episode ended "
                f"({self._end_reason}); call env.reset() to start a new episode"
            )

    # ------------------------------------------------------------------ read-only state
    @property
    def tools(self) -> list[dict[str, Any]]:
        """The env's tool schemas, as the last reset's info carried them (``[]`` before the
        first reset, or when the env publishes none)."""
        return list(self._tools)

    @property
    def turn(self) -> int:
        """Turns taken in the current episode (the hub's count, from each step's info)."""
        return self._turn

    @property
    def done(self) -> bool:
        """Whether the current episode has ended (terminated, truncated, or failed on the hub)."""
        return self._done

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The whole transcript of the current episode, the actions included (kept here, as
        ``TextEnv.messages`` has it)."""
        return list(self._history)

    def close(self) -> None:
        """End the session on the hub (frees its env at once). Safe to call twice."""
        self._link.close()

    # ------------------------------------------------------------------ the session
    @property
    def url(self) -> str:
        """The hub's session endpoint, ``ws://HOST:PORT/v1/session``."""
        return self._link.url

    @property
    def session(self) -> str:
        """The hub's id of this env's session (a new one after ``reset`` reopened it)."""
        return self._link.session

    @property
    def resume_key(self) -> str:
        """The secret that resumes this session after a dropped socket."""
        return self._link.resume_key

    @property
    def reconnects(self) -> int:
        """Sessions resumed after a dropped socket, and reopened by ``reset``."""
        return self._link.reconnects

    @property
    def draining(self) -> bool:
        """Whether the hub said it is shutting down (finish the episode; resets are refused)."""
        return self._link.draining

    @property
    def max_turns(self) -> int | None:
        """The turn limit the hub serves this env with, as its welcome said."""
        return self._link.max_turns

    def __repr__(self) -> str:
        return f"RemoteEnv({self.env_id!r}, hub={self.url!r}, session={self.session!r})"


def _gym_spec(env_id: str, hub: str) -> Any:
    """A Gymnasium spec for ``env_id`` whose ``gymnasium.make`` opens a RemoteEnv on ``hub``
    (no token in it: a spec is printed and pickled); None for an id Gymnasium cannot parse."""
    from gymnasium.envs.registration import EnvSpec

    try:
        return EnvSpec(
            id=env_id, entry_point="envhub.client:RemoteEnv", kwargs={"env_id": env_id, "hub": hub}
        )
    except gym.error.Error:
        return None
