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
   another connection. A close the hub makes carries its ``error`` message as the close
   frame's reason too (a client whose send fails first still learns why).

Every integer a client sends is bounded (``seq`` to 63 bits, ``seed`` to 64) and every
``options`` object must encode as the worker will encode it (integers within 64 bits,
nesting under 255 levels, valid Unicode), so bad input is refused here, with the field
named, before the hub places an episode or answers with the value.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    StrictFloat,
    TypeAdapter,
    WithJsonSchema,
)
from typing_extensions import TypeAliasType

__all__ = [
    "AssistantAction",
    "ClientMessage",
    "CloseRequest",
    "EnvInfo",
    "EnvList",
    "ErrorCode",
    "ErrorMessage",
    "Health",
    "Hello",
    "ProtocolSchema",
    "ResetRequest",
    "RolloutRequest",
    "RolloutResponse",
    "StepRequest",
    "Strict",
    "Welcome",
    "client_message",
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
    "env_unavailable",
    "not_found",
    "internal",
]

MAX_SEQ = 2**63 - 1
"""The largest ``seq``: a client numbering from 1 never gets there."""
MAX_SEED = 2**64 - 1
"""Seeds are what Gymnasium's ``np_random`` takes (non-negative) and fit 64 bits."""

_UNENCODABLE = (
    ("Integer exceeds 64-bit range", "an integer does not fit 64 bits"),
    ("Recursion limit reached", "it nests deeper than 254 levels"),
    ("surrogates not allowed", "a string holds a lone surrogate (not valid Unicode)"),
)


def _encodable(value: Any) -> dict[str, Any]:
    """``value`` if it is a JSON object the worker can encode (``orjson``), else a ``ValueError``
    that says why."""
    if not isinstance(value, dict):
        # pydantic reports a ValueError as a validation error; a TypeError would escape it
        raise ValueError(f"must be a JSON object, got {type(value).__name__}")  # noqa: TRY004
    try:
        orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError) as exc:
        why = next((plain for raw, plain in _UNENCODABLE if raw in str(exc)), str(exc))
        raise ValueError(
            f"{why}; send plain JSON: integers within 64 bits, nesting under 255 levels, valid "
            "Unicode text"
        ) from None
    if not _finite(value):  # orjson would write null: the env would get None for a number
        raise ValueError("holds NaN or Infinity, which JSON has not; send finite numbers")
    return value


def _finite(value: Any) -> bool:
    """No float in ``value`` (nested dicts and lists) is NaN or infinite."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


def _unicode(text: str) -> str:
    """``text`` if it is valid Unicode (encodes to UTF-8), else a ``ValueError``."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"holds a lone surrogate at index {exc.start} (not valid Unicode); send UTF-8 text"
        ) from None
    return text


_JsonInt = Annotated[int, Field(ge=-(2**63), le=MAX_SEED)]
_JsonFloat = Annotated[StrictFloat, WithJsonSchema({"type": "number", "not": {"type": "integer"}})]
JsonValue = TypeAliasType(
    "JsonValue",
    # one string, evaluated lazily by pydantic: mypy resolves a recursive TypeAliasType only
    # in this form (python/mypy#18252), and Python 3.11 has no ``type`` statement
    "None | bool | _JsonInt | _JsonFloat | str | list[JsonValue] | dict[str, JsonValue]",
)
"""What ``options`` may hold, as published in the schemas (integers within 64 bits; no depth in JSON
Schema)."""
JsonObject = Annotated[
    dict[str, Any], PlainValidator(_encodable, json_schema_input_type=dict[str, JsonValue])
]
"""A JSON object the hub can pass to a worker unchanged (checked by encoding it once, as the worker
will)."""
Text = Annotated[str, AfterValidator(_unicode)]
"""A string that encodes to UTF-8 (JSON escapes can spell lone surrogates; they are refused)."""
Seq = Annotated[int, Field(ge=1, le=MAX_SEQ)]


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):  # pydantic would take true for 1
        raise ValueError("must be an integer, got a boolean")  # noqa: TRY004 - see _encodable
    return value


Seed = Annotated[int, Field(ge=0, le=MAX_SEED), BeforeValidator(_not_bool)]


class Strict(BaseModel):
    """Base of every wire type: unknown fields are an error."""

    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------- client -> server
class Hello(Strict):
    """Open a session on ``env``, or resume ``session`` with its ``resume_key``."""

    type: Literal["hello"]
    env: str | None = Field(default=None, max_length=200, description="Env id for a new session.")
    session: str | None = Field(default=None, max_length=64, description="Session id to resume.")
    resume_key: str | None = Field(
        default=None, max_length=128, description="The key ``welcome`` gave."
    )
    env_kwargs: dict[str, Any] | None = Field(
        default=None, description="Refused: the hub fixes env kwargs; serve a variant id."
    )


class ResetRequest(Strict):
    type: Literal["reset"]
    seq: Seq
    seed: Seed | None = None
    options: JsonObject | None = None


class WireFunction(Strict):
    name: Text = Field(max_length=256)
    arguments: Text | JsonObject = Field(
        description="The call's arguments: a JSON string (as chat APIs send it) or an object."
    )


class WireToolCall(Strict):
    id: Text | None = Field(default=None, max_length=128)
    type: Literal["function"] = "function"
    function: WireFunction


class AssistantAction(Strict):
    """A structured action: the model's reply as its chat API returned it (OpenAI format)."""

    role: Literal["assistant"] = "assistant"
    content: Text | None = None
    tool_calls: list[WireToolCall] = Field(default_factory=list, max_length=64)


class StepRequest(Strict):
    type: Literal["step"]
    seq: Seq
    action: str | AssistantAction = Field(
        description="The model's text (WebSocket frames are UTF-8, so no lone surrogates get "
        "here), or its reply as an assistant message with tool_calls (a structured action)."
    )

    def env_action(self) -> str | dict[str, Any]:
        """The action as ``TextEnv.step`` takes it."""
        if isinstance(self.action, str):
            return self.action
        return self.action.model_dump(exclude_none=True)


class CloseRequest(Strict):
    type: Literal["close"]
    seq: Seq


ClientMessage = Annotated[
    Hello | ResetRequest | StepRequest | CloseRequest, Field(discriminator="type")
]
client_message: TypeAdapter[Hello | ResetRequest | StepRequest | CloseRequest] = TypeAdapter(
    ClientMessage
)


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
    Welcome
    | ErrorMessage
    | ResetResultMessage
    | StepResultMessage
    | EpisodeFailedMessage
    | ClosedMessage
    | DrainingMessage,
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
    """``/health``: ``degraded`` (still HTTP 200: the process is alive) lists in ``problems`` what a
    client would hit."""

    status: Literal["ok", "degraded", "draining"]
    sessions: int
    workers_alive: int
    workers: int
    problems: list[str] = Field(
        default_factory=list,
        description="Why the hub is degraded, one line per problem, with the fix.",
    )


class RolloutRequest(Strict):
    """A one-shot episode over HTTP: reset with ``seed``/``options``, then apply ``actions``."""

    env: Text = Field(max_length=200)
    seed: Seed | None = None
    options: JsonObject | None = None
    actions: list[Text] = Field(default_factory=list, max_length=1000)


class RolloutResponse(Strict):
    env: str
    reset: dict[str, Any] | None
    steps: list[dict[str, Any]]
    failure: dict[str, Any] | None = None
    error: ErrorMessage | None = Field(
        default=None, description="Why the actions stopped early (e.g. the episode ended)."
    )


class ProtocolSchema(Strict):
    """JSON Schemas of the WebSocket messages, for clients in other languages."""

    client: dict[str, Any]
    server: dict[str, Any]
