"""OpenEnv's WebSocket messages, as strict pydantic models, and the envhub episode inside them.

OpenEnv's client (``openenv.core.EnvClient``, openenv-core 0.3) sends one JSON object per
text frame and waits for one answer:

======================================  ============================================
client -> server                        server -> client
======================================  ============================================
``{"type": "reset", "data": {...}}``    ``{"type": "observation", "data": RESULT}``
``{"type": "step", "data": ACTION}``    ``{"type": "observation", "data": RESULT}``
``{"type": "state"}``                   ``{"type": "state", "data": {...}}``
``{"type": "close"}``                   (the server closes the socket)
anything that fails                     ``{"type": "error", "data": {"message", "code"}}``
======================================  ============================================

``RESULT`` is ``{"observation": {...}, "reward": float | None, "done": bool}``. For an envhub
env served this way (see ``envhub.server.openenv``):

- reset ``data``: ``seed`` (int >= 0), ``episode_id`` (str, echoed in the state) and
  ``options`` (the env's ``reset(options=...)``); nothing else.
- ``ACTION``: ``{"message": "<the model's text>"}`` (plus OpenEnv's optional ``metadata``):
  one required string field, the shape of OpenEnv's own text envs.
- ``observation``: ``{"messages": [...], "info": {...}, "terminated": bool, "truncated":
  bool}``: the chat messages new this turn and the env's info, as ``TextEnv`` returns them;
  ``done`` is ``terminated or truncated``.

Error codes are OpenEnv's (``INVALID_JSON``, ``UNKNOWN_TYPE``, ``VALIDATION_ERROR``,
``EXECUTION_ERROR``, ``CAPACITY_REACHED``, ``SESSION_ERROR``), plus ``UNAUTHORIZED``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

__all__ = [
    "CloseMessage",
    "Metadata",
    "ResetData",
    "ResetMessage",
    "Schemas",
    "StateMessage",
    "StepAction",
    "StepMessage",
    "client_message",
    "error",
    "observation",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ResetData(_Strict):
    """What a reset may carry."""

    seed: int | None = Field(default=None, ge=0, le=2**64 - 1, strict=True)
    episode_id: str | None = Field(default=None, max_length=255)
    options: dict[str, Any] = Field(default_factory=dict)


class StepAction(_Strict):
    """The action of an envhub env: the model's text."""

    message: str = Field(description="The model's text, exactly as it wrote it.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Ignored; OpenEnv's.")


class ResetMessage(_Strict):
    type: Literal["reset"]
    data: ResetData = Field(default_factory=ResetData)


class StepMessage(_Strict):
    type: Literal["step"]
    data: StepAction


class StateMessage(_Strict):
    type: Literal["state"]


class CloseMessage(_Strict):
    type: Literal["close"]


class Schemas(_Strict):
    """``GET /schema``: JSON Schemas of the action, the observation and the state."""

    action: dict[str, Any]
    observation: dict[str, Any]
    state: dict[str, Any]


class Metadata(_Strict):
    """``GET /metadata``: what the env is (OpenEnv's ``EnvironmentMetadata``)."""

    name: str
    description: str
    version: str
    author: str = "envhub"


client_message: TypeAdapter[ResetMessage | StepMessage | StateMessage | CloseMessage] = TypeAdapter(
    Annotated[ResetMessage | StepMessage | StateMessage | CloseMessage, Field(discriminator="type")]
)


def error(code: str, message: str, **details: Any) -> str:
    """An OpenEnv ``error`` answer."""
    return orjson.dumps(
        {"type": "error", "data": {"message": message, "code": code, **details}}
    ).decode()


def observation(
    messages: Any, info: Any, reward: float | None, terminated: bool, truncated: bool
) -> str:
    """An OpenEnv ``observation`` answer holding one envhub reset or step."""
    return orjson.dumps(
        {
            "type": "observation",
            "data": {
                "observation": {
                    "messages": messages,
                    "info": info,
                    "terminated": terminated,
                    "truncated": truncated,
                },
                "reward": reward,
                "done": terminated or truncated,
            },
        }
    ).decode()
