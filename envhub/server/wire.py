"""The hub's wire types: every HTTP body and WebSocket message, as strict pydantic models.

Every model forbids unknown fields (``extra="forbid"``) and is validated with
``model_validate``/``model_validate_json``, on the server and in the client alike.

WebSocket session protocol (``/v1/session``; text frames, one JSON object each)
------------------------------------------------------------------------------
1. The client sends ``hello`` (``env`` for a new session; ``session`` + ``resume_key`` to
   resume one after a dropped socket). The server answers ``welcome`` with the session id,
   the resume key, and ``last_seq``: the highest request it has answered.
2. Requests carry ``seq``: 1, 2, 3, ... one at a time. A request with the ``seq`` of the
   last answered one gets the same answer again (nothing is applied twice); the next
   ``seq`` is applied once. After a resume the client resends its unanswered request.
3. Answers: ``reset_result`` / ``step_result`` (``result`` is exactly what the env's
   ``reset``/``step`` returned), ``episode_failed`` (the worker crashed or hung; ``failure``
   says why; ``reset`` starts a new episode), ``closed``, or ``error`` with a ``code``.
4. The server may send ``draining`` at any time: finish the episode; new resets are
   refused. WebSocket close codes: 1000 closed by request, 1001 server shut down,
   1008 unauthorized, 1009 message too big, 1013 over a session limit or draining,
   4408 idle timeout, 4404 unknown session on resume, 4409 the session was resumed on
   another connection.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

__all__ = [
    "Strict",
    "Hello",
    "ResetRequest",
    "StepRequest",
    "CloseRequest",
    "ClientMessage",
    "client_message",
    "Welcome",
    "ErrorMessage",
    "ErrorCode",
    "EnvInfo",
    "EnvList",
    "Health",
    "RolloutRequest",
    "RolloutResponse",
    "ProtocolSchema",
]

ErrorCode = Literal[
    "bad_json",
    "bad_message",
    "message_too_large",
    "unauthorized",
    "unknown_env",
    "env_kwargs_refused",
    "hello_required",
    "hello_timeout",
    "too_many_sessions",
    "draining",
    "unknown_session",
    "reset_needed",
    "episode_over",
    "bad_seq",
    "busy",
    "idle_timeout",
    "pool_busy",
    "internal",
]


class Strict(BaseModel):
    """Base of every wire type: unknown fields are an error."""

    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------- client -> server
class Hello(Strict):
    """Open a session on ``env``, or resume ``session`` with its ``resume_key``."""

    type: Literal["hello"]
    env: str | None = Field(None, max_length=200, description="Env id for a new session.")
    session: str | None = Field(None, max_length=64, description="Session id to resume.")
    resume_key: str | None = Field(None, max_length=128, description="The key ``welcome`` gave.")
    env_kwargs: dict[str, Any] | None = Field(None, description="Refused: the hub fixes env kwargs; serve a variant id.")


class ResetRequest(Strict):
    type: Literal["reset"]
    seq: int = Field(ge=1)
    seed: int | None = None
    options: dict[str, Any] | None = None


class StepRequest(Strict):
    type: Literal["step"]
    seq: int = Field(ge=1)
    action: str


class CloseRequest(Strict):
    type: Literal["close"]
    seq: int = Field(ge=1)


ClientMessage = Annotated[Hello | ResetRequest | StepRequest | CloseRequest, Field(discriminator="type")]
client_message: TypeAdapter[Hello | ResetRequest | StepRequest | CloseRequest] = TypeAdapter(ClientMessage)


# ---------------------------------------------------------------------- server -> client
class Welcome(Strict):
    type: Literal["welcome"] = "welcome"
    session: str
    resume_key: str
    env: str
    last_seq: int
    resumed: bool
    grace_s: float
    idle_timeout_s: float
    max_message_bytes: int
    max_turns: int | None = None


class ErrorMessage(Strict):
    type: Literal["error"] = "error"
    code: ErrorCode
    message: str
    seq: int | None = None


class ResetResultMessage(Strict):
    type: Literal["reset_result"]
    seq: int
    episode: int
    result: dict[str, Any]


class StepResultMessage(Strict):
    type: Literal["step_result"]
    seq: int
    result: dict[str, Any]


class EpisodeFailedMessage(Strict):
    type: Literal["episode_failed"]
    seq: int
    failure: dict[str, Any]


class ClosedMessage(Strict):
    type: Literal["closed"]
    seq: int


class DrainingMessage(Strict):
    type: Literal["draining"]
    message: str


ServerMessage = Annotated[
    Welcome | ErrorMessage | ResetResultMessage | StepResultMessage | EpisodeFailedMessage | ClosedMessage | DrainingMessage,
    Field(discriminator="type"),
]
server_message: TypeAdapter[Any] = TypeAdapter(ServerMessage)


# ---------------------------------------------------------------------- HTTP
class EnvInfo(Strict):
    id: str
    description: str
    max_turns: int | None
    workers: int
    workers_alive: int
    episodes: int


class EnvList(Strict):
    envs: list[EnvInfo]


class Health(Strict):
    status: Literal["ok", "draining"]
    sessions: int
    workers_alive: int
    workers: int


class RolloutRequest(Strict):
    """A one-shot episode over HTTP: reset with ``seed``/``options``, then apply ``actions``."""

    env: str = Field(max_length=200)
    seed: int | None = None
    options: dict[str, Any] | None = None
    actions: list[str] = Field(default_factory=list, max_length=1000)


class RolloutResponse(Strict):
    env: str
    reset: dict[str, Any] | None
    steps: list[dict[str, Any]]
    failure: dict[str, Any] | None = None
    error: ErrorMessage | None = Field(None, description="Why the actions stopped early (e.g. the episode ended).")


class ProtocolSchema(Strict):
    """JSON Schemas of the WebSocket messages, for clients in other languages."""

    client: dict[str, Any]
    server: dict[str, Any]
