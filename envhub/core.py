"""The multi-turn text environment contract: ``TextEnv``.

A ``TextEnv`` is a ``gymnasium.Env`` whose observations are chat messages and whose actions
are the raw text a language model wrote. Everything else in envhub (the checker, pools, the
server, the trainer's rollout loop) relies only on the guarantees listed here.

What an environment author implements
-------------------------------------
``on_reset(options) -> (observation, info)``
    Start a new episode. ``self.np_random`` is already seeded: draw every random choice
    from it, so the same seed always gives the same episode. ``options`` is the dict passed
    to ``reset(options=...)``; task-driven environments read their task from
    ``options["task"]``. Return the opening observation (a string, one message or a list of
    messages) and an info dict.
``on_step(action) -> Turn``
    Apply the model's text. Return a ``Turn``: the environment's reply, the reward, whether
    the episode has terminated (reached a goal or a dead end), and info. Never raise for a
    malformed action: return ``self.invalid_action(feedback)`` so the model learns from it.
Optional: ``tools`` (OpenAI function schemas the model may call), ``system_prompt``,
``expert_action()`` (a good next action, for demos, tests and warm-start data), ``on_close``.
An env that wants tool calls as data rather than text sets ``structured_actions = True`` and
implements ``on_message(message) -> Turn``: a structured action (an assistant message with
``tool_calls``, as a model's chat API returns it) then reaches it as it is; text actions still
reach ``on_step``.

What ``TextEnv`` guarantees to its callers
------------------------------------------
1. ``reset(seed=s, options=o)`` returns ``(messages, info)``: ``messages`` is a non-empty
   ``list`` of ``{"role": str, "content": str}`` dicts (the system prompt, if any, first);
   the same ``(s, o)`` gives the same episode.
2. ``step(action)`` returns ``(messages, reward, terminated, truncated, info)``: ``messages``
   holds only what is *new* this turn (the agent keeps its own history, so token ids never
   need re-tokenising); ``reward`` is a finite ``float``. ``action`` is the model's text, or
   an assistant message ``{"role": "assistant", "content": str | None, "tool_calls": [...]}``
   (OpenAI format): an env without ``structured_actions`` gets it as text, the calls written in
   envhub's ``<tool_call>`` form (``envhub.parsing.message_text``), so every env takes both.
3. ``info`` always carries ``turn`` (turns taken so far), ``success`` (``bool``) and
   ``invalid_action`` (``bool``: the action could not be parsed or was illegal). Reset info
   also carries ``tools`` when the environment publishes tool schemas, and
   ``structured_actions: True`` when it reads assistant messages as data. Those schemas are
   well formed: ``reset`` raises ``envhub.errors.ToolSchemaError``, naming every problem,
   for tools that are not OpenAI function schemas with unique names and a valid JSON Schema
   ``parameters`` object (checked once per distinct tool list).
4. After ``max_turns`` steps an episode that has not terminated first ends the way the
   class's ``out_of_turns`` says: ``truncated=True`` by default (a time limit outside the
   task: the last state was not terminal), or ``terminated=True`` when the budget is a rule
   of the task the agent was told (Wordle's six guesses, a coding task's attempts: running
   out is a loss). ``terminated`` and ``truncated`` are never both true.
5. ``step()`` before ``reset()`` raises ``ResetNeededError``; ``step()`` after the end raises
   ``EpisodeOverError``; an action that is neither a ``str`` nor an assistant message (a dict
   with ``content`` a string or None, ``tool_calls`` a list) raises ``TypeError``. All name
   the fix.
6. ``close()`` may be called any number of times. Environments are picklable, so process
   workers can receive them.
7. Observations and info contain only JSON-serialisable values, so they can cross a network.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeAlias

import gymnasium as gym
import numpy as np

from envhub.errors import EpisodeOverError, ResetNeededError

__all__ = [
    "ROLES",
    "ChatSpace",
    "Message",
    "Observation",
    "TextEnv",
    "TextSpace",
    "Turn",
    "as_messages",
    "assistant_message",
    "function_tool",
    "messages_to_text",
    "render_transcript",
]

Message: TypeAlias = dict[str, Any]
"""One chat message: ``{"role": "system" | "user" | "assistant" | "tool", "content": str}``.

Tool messages may also carry ``name`` and ``tool_call_id``."""

Observation: TypeAlias = list[Message]
ROLES: frozenset[str] = frozenset({"system", "user", "assistant", "tool"})

_PRINTABLE = np.array(
    list("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?<>/[]")
)


class ChatSpace(gym.spaces.Space[Observation]):
    """The observation space of a ``TextEnv``: a list of chat messages.

    ``contains`` checks the structure (roles, string contents, JSON-friendly extra keys);
    ``sample`` returns one random user message, which is only useful for testing consumers.
    """

    def __init__(self, max_content_length: int = 1_000_000, seed: int | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)
        self.max_content_length = max_content_length

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def contains(self, x: Any) -> bool:
        if not isinstance(x, list):
            return False
        for message in x:
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                return False
            content = message.get("content")
            if not isinstance(content, str) or len(content) > self.max_content_length:
                return False
        return True

    def sample(self, mask: Any = None, probability: Any = None) -> Observation:
        length = int(self.np_random.integers(1, 40))
        text = "".join(self.np_random.choice(_PRINTABLE, size=length))
        return [{"role": "user", "content": text}]

    def __repr__(self) -> str:
        return f"ChatSpace(max_content_length={self.max_content_length})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChatSpace) and other.max_content_length == self.max_content_length


class TextSpace(gym.spaces.Space[str]):
    """The action space of a ``TextEnv``: any string of at most ``max_length`` characters.

    Unlike ``gymnasium.spaces.Text`` there is no character set: a model may write anything.
    ``sampler(np_random) -> str``, when given, makes ``sample()`` return plausible actions
    (a mix of well-formed and malformed ones), which random agents and the checker use.
    """

    def __init__(
        self,
        max_length: int = 100_000,
        sampler: Callable[[np.random.Generator], str] | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)
        self.max_length = max_length
        self.sampler = sampler

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        if self.sampler is not None:
            return self.sampler(self.np_random)
        length = int(self.np_random.integers(0, 40))
        return "".join(self.np_random.choice(_PRINTABLE, size=length))

    def __repr__(self) -> str:
        return f"TextSpace(max_length={self.max_length})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TextSpace) and other.max_length == self.max_length


@dataclass
class Turn:
    """What ``TextEnv.on_step`` returns: the environment's side of one turn.

    ``observation`` is the reply shown to the model: a string (sent as one ``user``
    message), a single message dict, or a list of messages. Using up ``max_turns`` is handled by the
    base class (see ``TextEnv.out_of_turns``); set ``terminated`` when the episode really ended.
    """

    observation: str | Message | Sequence[Message]
    reward: float = 0.0
    terminated: bool = False
    success: bool = False
    invalid_action: bool = False
    info: dict[str, Any] = field(default_factory=dict)


def as_messages(observation: str | Message | Sequence[Message], role: str = "user") -> Observation:
    """Normalise an observation (text, one message, or messages) to a list of messages."""
    if isinstance(observation, str):
        return [{"role": role, "content": observation}]
    if isinstance(observation, dict):
        return [dict(observation)]
    return [dict(message) for message in observation]


def messages_to_text(messages: Sequence[Message], *, with_roles: bool = False) -> str:
    """The plain-text view of an observation, for simple agents and terminals."""
    if with_roles:
        return "\n\n".join(f"[{m['role']}] {m['content']}" for m in messages)
    return "\n\n".join(str(m["content"]) for m in messages)


def render_transcript(history: Sequence[Message], mode: str | None) -> str | None:
    """What ``render()`` gives in ``mode`` for an episode's transcript ``history``: ``ansi``,
    the text with roles; ``human``, that text printed (None returned); ``None``, nothing. Local
    and remote envs (``envhub.client.RemoteEnv``) render alike through it."""
    if mode is None:
        return None
    text = messages_to_text(history, with_roles=True)
    if mode == "human":
        print(text)
        return None
    return text


def function_tool(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """A tool schema in the OpenAI function-calling format.

    ``parameters`` is a JSON Schema object, e.g. ``{"type": "object", "properties": {...},
    "required": [...]}``. Nothing is checked here (tool lists are built in class bodies, where an
    error would stop the env's module from importing): ``TextEnv.reset`` checks an env's tools.
    """
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def assistant_message(action: Any, owner: str = "TextEnv") -> Message:
    """``action`` checked as a structured action: a dict with ``content`` (a string or None) and
    ``tool_calls`` (a list, possibly absent), role ``assistant`` if given. Returns a clean copy;
    anything else raises ``TypeError`` naming what ``step`` takes."""
    fix = (
        f"{owner}.step() takes the model's text (a str) or an assistant message "
        '{"role": "assistant", "content": str | None, "tool_calls": [...]}'
    )
    if not isinstance(action, dict):
        raise TypeError(f"{fix}; got {type(action).__name__}: {action!r:.80}")
    role, content = action.get("role", "assistant"), action.get("content")
    calls = action.get("tool_calls") or []
    if role != "assistant" or not isinstance(content, str | None) or not isinstance(calls, list):
        raise TypeError(f"{fix}; got {action!r:.120}")
    message: Message = {"role": "assistant", "content": content or ""}
    if calls:
        message["tool_calls"] = list(calls)
    return message


class TextEnv(gym.Env[Observation, str]):
    """Base class of every multi-turn text environment (see the module docstring)."""

    metadata: dict[str, Any] = {  # noqa: RUF012 - typed as gymnasium.Env types it (not ClassVar)
        "render_modes": ["ansi", "human"],
        "render_fps": 1,
    }

    system_prompt: str | None = None
    """Sent as the first message of every episode when set."""

    tools: list[dict[str, Any]] = []  # noqa: RUF012 - a read-only default; envs assign their own
    """OpenAI-format tool schemas the model may call (see ``function_tool``); ``reset`` refuses
    malformed ones (guarantee 3)."""

    invalid_action_penalty: float = -0.1
    """Reward given by ``invalid_action()`` unless a penalty is passed explicitly."""

    structured_actions: ClassVar[bool] = False
    """Whether an assistant message reaches ``on_message`` as data (tool calls with their ids and
    JSON arguments) instead of ``on_step`` as text."""

    out_of_turns: ClassVar[Literal["truncated", "terminated"]] = "truncated"
    """How using up ``max_turns`` ends an episode (guarantee 4): ``"truncated"`` when the limit
    is outside the task (a step budget; Gymnasium's ``TimeLimit``), ``"terminated"`` when it is
    one of the task's own rules (out of guesses or attempts: the game is lost)."""

    def __init__(
        self,
        *,
        max_turns: int | None = None,
        render_mode: Literal["ansi", "human"] | None = None,
        action_max_length: int = 100_000,
    ) -> None:
        if max_turns is not None and max_turns < 1:
            raise ValueError(f"max_turns must be a positive int or None, got {max_turns!r}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(
                f"render_mode={render_mode!r} is not supported; use one of "
                f"{self.metadata['render_modes']} or None"
            )
        self.max_turns = max_turns
        self.render_mode = render_mode
        self.observation_space = ChatSpace()
        self.action_space = TextSpace(max_length=action_max_length, sampler=self.sample_action)
        self._turn = 0
        self._state: Literal["new", "running", "over"] = "new"
        self._end_reason = ""
        self._history: Observation = []
        self._closed = False
        self._tools_checked: object = None
        """The ``tools`` list ``reset`` last found well formed (checked again once replaced)."""

    # ----------------------------------------------------------------- to implement
    def on_reset(
        self, options: dict[str, Any]
    ) -> tuple[str | Message | Sequence[Message], dict[str, Any]]:
        """Start an episode; return the opening observation and info (see module doc)."""
        raise NotImplementedError(f"{type(self).__name__} must implement on_reset(options)")

    def on_step(self, action: str) -> Turn:
        """Apply the model's text and return the environment's turn (see module doc)."""
        raise NotImplementedError(f"{type(self).__name__} must implement on_step(action)")

    def on_message(self, message: Message) -> Turn:
        """Apply a structured action (``structured_actions``): an assistant message with
        ``content`` and ``tool_calls``. The default reads it as text, like any other env."""
        from envhub.parsing import message_text

        return self.on_step(message_text(message))

    def sample_action(self, np_random: np.random.Generator) -> str:
        """A random action for random agents and the checker; override with plausible ones."""
        length = int(np_random.integers(0, 40))
        return "".join(np_random.choice(_PRINTABLE, size=length))

    def expert_action(self) -> str | None:
        """A good next action in the current state, or ``None`` if the env has no expert."""
        return None

    def on_close(self) -> None:
        """Release resources (processes, sandboxes, browsers). Called at most once."""

    # ----------------------------------------------------------------- helpers for authors
    def _not_text(self, action: str) -> Turn | None:
        """An invalid action for text with no UTF-8 form (a lone surrogate such as ``\\udcff``,
        which JSON can carry): no env could send it to a shell, a browser or a URL; and for text
        longer than ``action_space.max_length``, which then never reaches a parser."""
        limit = getattr(self.action_space, "max_length", None)
        if limit is not None and len(action) > limit:
            return self.invalid_action(
                f"The action is {len(action)} characters long; this env takes at most {limit}. "
                "Send a shorter action."
            )
        try:
            action.encode("utf-8")
        except UnicodeEncodeError as error:
            return self.invalid_action(
                f"The action is not valid text: {action[error.start : error.end]!r} at "
                f"character {error.start} has no UTF-8 form (a lone surrogate). "
                "Send plain UTF-8 text."
            )
        return None

    def invalid_action(self, feedback: str, *, penalty: float | None = None, **info: Any) -> Turn:
        """The turn to return for text that is not a legal action: a penalty and feedback."""
        reward = self.invalid_action_penalty if penalty is None else penalty
        return Turn(observation=feedback, reward=reward, invalid_action=True, info=info)

    # ----------------------------------------------------------------- the Gymnasium API
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Observation, dict[str, Any]]:
        super().reset(seed=seed)
        self._turn = 0
        observation, info = self.on_reset(dict(options or {}))
        if self.tools and self.tools is not getattr(self, "_tools_checked", None):
            from envhub.tool_schemas import validate_tools

            validate_tools(self.tools, type(self).__name__)
            self._tools_checked = self.tools
        messages = as_messages(observation)
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        self._history = list(messages)
        self._state = "running"
        self._end_reason = ""
        info = {"turn": 0, "success": False, "invalid_action": False, **info}
        if self.tools:
            info["tools"] = self.tools
        if self.structured_actions:
            info["structured_actions"] = True
        return messages, info

    def step(self, action: str | Message) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        if self._state == "new":
            raise ResetNeededError(
                f"{type(self).__name__}.step() was called before reset(); "
                "call env.reset(seed=...) to start an episode first"
            )
        if self._state == "over":
            raise EpisodeOverError(
                f"{type(self).__name__}.step() was called after the episode ended "
                f"({self._end_reason}); call env.reset() to start a new episode"
            )
        if isinstance(action, str):
            self._turn += 1
            self._history.append({"role": "assistant", "content": action})
            turn = self._not_text(action) or self.on_step(action)
        else:
            message = assistant_message(action, type(self).__name__)
            self._turn += 1
            self._history.append(message)
            if self.structured_actions:
                turn = self.on_message(message)
            else:
                from envhub.parsing import message_text

                text = message_text(message)
                turn = self._not_text(text) or self.on_step(text)
        messages = as_messages(turn.observation)
        reward = float(turn.reward)
        used_up = self.max_turns is not None and self._turn >= self.max_turns
        terminated = bool(turn.terminated) or (used_up and self.out_of_turns == "terminated")
        truncated = not terminated and used_up
        info = {
            **turn.info,
            "turn": self._turn,
            "success": bool(turn.success),
            "invalid_action": bool(turn.invalid_action),
        }
        if terminated or truncated:
            self._state = "over"
            self._end_reason = (
                f"{'terminated' if terminated else 'truncated'} after max_turns={self.max_turns}"
                if used_up and not turn.terminated
                else "terminated"
            )
        if not math.isfinite(reward):
            raise ValueError(
                f"{type(self).__name__}.on_step returned a non-finite reward {reward!r}"
            )
        self._history.extend(messages)
        if self.render_mode == "human":
            print(messages_to_text(messages))
        return messages, reward, terminated, truncated, info

    def render(self) -> str | None:
        """``ansi``: the whole transcript as text; ``human``: print it; ``None``: nothing."""
        return render_transcript(self._history, self.render_mode)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.on_close()

    # ----------------------------------------------------------------- read-only state
    @property
    def turn(self) -> int:
        """Turns taken in the current episode."""
        return self._turn

    @property
    def done(self) -> bool:
        """Whether the current episode has ended (terminated or truncated)."""
        return self._state == "over"

    @property
    def messages(self) -> Observation:
        """The whole transcript of the current episode, the model's actions included."""
        return list(self._history)
