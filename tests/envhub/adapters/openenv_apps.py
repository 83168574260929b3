"""OpenEnv servers for the adapter and protocol tests, built with openenv-core's own
``create_app`` (so they speak exactly its protocol), and two that speak something else."""

from __future__ import annotations

import random

from fastapi import FastAPI
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    text: str = ""


class GuessEnvironment(Environment):
    """Guess a number from 1 to 9 in three tries; the seed picks the number."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        self._state = State(step_count=0)
        self._target, self._left = 0, 0

    def reset(self, seed: int | None = None, episode_id: str | None = None) -> GuessObservation:
        self._target = random.Random(seed).randint(1, 9)
        self._left = 3
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(text="Guess my number from 1 to 9; you have 3 tries.")

    def step(self, action: GuessAction) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        self._left -= 1
        guess = action.message.strip()
        if guess == str(self._target):
            return GuessObservation(text="Right!", done=True, reward=1.0)
        hint = (
            "higher" if guess.isdigit() and int(guess) < self._target else "lower or not a number"
        )
        return GuessObservation(text=f"No: {hint}.", done=self._left == 0, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=64)


class PartialCreditEnvironment(Environment):
    """One question, one answer: 1.0 if right, 0.1 (partial credit for answering) if wrong."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(text="What is the capital of France? One answer.")

    def step(self, action: GuessAction) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        right = action.message.strip() == "Paris"
        return GuessObservation(
            text="Right." if right else "Wrong.", done=True, reward=1.0 if right else 0.1
        )

    @property
    def state(self) -> State:
        return self._state


partial_credit_app = create_app(
    PartialCreditEnvironment, GuessAction, GuessObservation, max_concurrent_envs=64
)
"""Pays partial credit for a wrong final answer, as many OpenEnv envs shape their rewards."""

no_schema_app = FastAPI()
"""An HTTP server that is not an OpenEnv server (or an OpenEnv older than /schema)."""


@no_schema_app.get("/health")
def _health() -> dict[str, str]:
    return {"status": "healthy"}


no_websocket_app = FastAPI()
"""Publishes an action schema but has no /ws route (an HTTP-only protocol version)."""


@no_websocket_app.get("/schema")
def _schema() -> dict[str, object]:
    return {"action": GuessAction.model_json_schema(), "observation": {}, "state": {}}


class ChatAction(Action):
    message: str


class ChatObservation(Observation):
    messages: list[dict[str, str]] = Field(default_factory=list)


class HistoryChatEnvironment(Environment):
    """OpenEnv's chat_env style: every observation's ``messages`` is the whole conversation so
    far (the system prompt, the agent's turns echoed back, the env's replies)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        self._state = State(step_count=0)
        self.history: list[dict[str, str]] = []

    def reset(self, seed: int | None = None, episode_id: str | None = None) -> ChatObservation:
        self.history = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Say hi."},
        ]
        self._state = State(episode_id=episode_id, step_count=0)
        return ChatObservation(messages=list(self.history))

    def step(self, action: ChatAction) -> ChatObservation:  # type: ignore[override]
        self._state.step_count += 1
        self.history += [
            {"role": "assistant", "content": action.message},
            {"role": "user", "content": f"reply {self._state.step_count}"},
        ]
        done = self._state.step_count >= 3
        return ChatObservation(messages=list(self.history), done=done, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


history_chat_app = create_app(
    HistoryChatEnvironment, ChatAction, ChatObservation, max_concurrent_envs=64
)
"""Sends the whole conversation in ``messages`` at every step."""


class NewMessagesChatEnvironment(HistoryChatEnvironment):
    """Sends only the new messages at each step (the env's reply), as most envs do."""

    def step(self, action: ChatAction) -> ChatObservation:  # type: ignore[override]
        full = super().step(action)
        return ChatObservation(messages=full.messages[-1:], done=full.done, reward=full.reward)


new_messages_chat_app = create_app(
    NewMessagesChatEnvironment, ChatAction, ChatObservation, max_concurrent_envs=64
)
