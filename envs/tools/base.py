"""What every function-calling env shares: tool schemas, call parsing, tool messages, answers.

A ``ToolEnv`` publishes OpenAI-format tool schemas (``self.tools``, also in reset info), reads
calls from the model's text as JSON in ``<tool_call>...</tool_call>`` tags
(``envhub.parsing.ToolCallParser``) and answers each call with a
``{"role": "tool", "name": ..., "tool_call_id": ..., "content": ...}`` message. The episode
ends when the model writes a final ``<answer>...</answer>``, which the subclass grades.

A subclass implements four things:

``start(task) -> str``
    Set up the task (build a database, pick documents) and return the question.
``call_tool(name, arguments) -> str``
    Run one (already schema-checked) call; raise ``ToolError`` for a call that is well formed
    but fails (bad SQL, unknown document): its message goes back to the model.
``grade(answer) -> float``
    Score the final answer in ``[0, 1]``; ``1.0`` is a success. Graders read the answer with
    ``envs.tools.answers`` (one normaliser, one rule for numbers and one for names), so every
    env accepts the same forms of a right answer and refuses an answer listing candidates.
``plan() -> list[str]``
    The oracle's actions for the current task (tool calls, then the answer), computed at
    ``start``; ``expert_action()`` walks it.

The system prompt lists the tools (JSON) and says how to call them in text: the protocol for a
model whose chat template renders no tools. Where the tools go through the template
(``apply_chat_template(..., tools=...)``: the trainer's native tool calling, ``envhub eval
--tools native``), the template lists them in its own format, so a caller turns the env's
listing off with ``reset(options={"describe_tools": False})`` (or ``describe_tools=False`` as
the default), keeping only the task and how to answer.

Rewards: the graded score on the answer turn, ``invalid_action_penalty`` for text that is
neither a valid call nor an answer, 0 for tool turns. Tool output is truncated to
``max_tool_chars`` so a flood never reaches the model whole; a call longer than
``max_call_chars``, nested too deeply or holding text that is not valid Unicode is an invalid
action (``ToolCallParser``), never passed to a tool.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import numpy as np

from envhub.core import Message, TextEnv, Turn
from envhub.errors import ActionParseError
from envhub.parsing import (
    ToolCall,
    ToolCallParser,
    extract_answer,
    format_tool_call,
    message_text,
)
from envs.datasets import Split, Task, TaskSet, as_taskset

__all__ = ["ToolEnv", "ToolError", "truncate"]

ANSWER_WITH_CALLS = (
    "Your <answer> was not taken: a reply that calls tools gets their results first. Give the "
    "answer in a reply of its own, once you have what you need."
)
"""What a reply with both tool calls and an answer hears after the results (the calls run,
the answer waits: it may depend on them)."""


class ToolError(Exception):
    """A well-formed tool call that failed; the message is shown to the model as the result."""


def truncate(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters with a note saying how much was dropped."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [truncated {len(text) - limit} characters]"


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


_BUILTIN_TASKSETS: dict[tuple[Any, ...], TaskSet] = {}
"""Built-in task sets by (env class, ``builtin_key()``, eval fraction)."""


class ToolEnv(TextEnv):
    """Base class of the ``tools/`` envs (see the module docstring)."""

    tool_schemas: ClassVar[list[dict[str, Any]]] = []
    """The OpenAI-format schemas of this env's tools (subclasses set it, or set ``self.tools``)."""
    structured_actions = True  # tool calls as data too: an assistant message's tool_calls
    required_fields: tuple[str, ...] = ()
    """Fields every task of a user dataset (or ``reset(options={"task": ...})``) must have."""
    generated_fields: tuple[str, ...] = ()
    """The fields of a task the env generates from its seed (the built-in tasks' own form):
    a custom task that has them needs none of ``required_fields``."""
    intro = "Answer the question using the tools."

    def __init__(
        self,
        *,
        dataset: str | TaskSet | Iterable[Mapping[str, Any]] | None = None,
        split: Split = "all",
        eval_fraction: float = 0.0,
        max_turns: int | None = 12,
        max_calls_per_turn: int = 4,
        max_call_chars: int = 100_000,
        max_tool_chars: int = 2_000,
        invalid_action_penalty: float = -0.1,
        describe_tools: bool = True,
        render_mode: Any = None,
    ) -> None:
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        if dataset is None:
            dataset = self._builtin_taskset(eval_fraction)
        self.tasks = as_taskset(
            dataset,
            default=(),
            split=split,
            eval_fraction=eval_fraction,
            required=self.required_fields if dataset is not None else (),
            name=type(self).__name__,
        )
        self.tools = list(self.tool_schemas)
        self.parser = ToolCallParser(
            tools=tuple(self.tools), max_calls=max_calls_per_turn, max_call_chars=max_call_chars
        )
        self.max_tool_chars = max_tool_chars
        self.invalid_action_penalty = invalid_action_penalty
        self.describe_tools = _flag(describe_tools, "describe_tools")
        """List the tools in the system prompt unless a reset's options say otherwise."""
        self._describing = self.describe_tools
        """Whether this episode's system prompt lists the tools."""
        self.system_prompt = self._system_prompt()
        self.task: Task = {}
        self.question = ""
        """This episode's question as the model sees it (graders ignore numbers it states)."""
        self._plan: list[str] = []
        self._plan_position = 0

    def _builtin_taskset(self, eval_fraction: float) -> TaskSet:
        """The built-in tasks as a ``TaskSet``, built once per class and ``builtin_key()`` (an
        env is made for every episode: generating thousands of tasks each time cost ~0.5 s)."""
        key = self.builtin_key()
        cache_key = (type(self), key, eval_fraction)
        cached = _BUILTIN_TASKSETS.get(cache_key) if key is not None else None
        if cached is None:
            tasks = self.builtin_tasks()
            cached = (
                tasks
                if isinstance(tasks, TaskSet)
                else TaskSet(tasks, name=type(self).__name__, eval_fraction=eval_fraction)
            )
            if key is not None:
                _BUILTIN_TASKSETS[cache_key] = cached
        return cached

    # ----------------------------------------------------------------- for subclasses
    def builtin_key(self) -> tuple[Any, ...] | None:
        """What ``builtin_tasks()`` depends on besides the class (e.g. how many it makes), so the
        set is built once and shared (tasks are read-only); None: build it for every env."""
        return None

    def builtin_tasks(self) -> TaskSet | Iterable[Mapping[str, Any]]:
        """The tasks used when no ``dataset`` is given."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement builtin_tasks() (or be given a dataset)"
        )

    def start(self, task: Task) -> str:
        """Prepare ``task`` (databases, documents, servers); return the opening question."""
        raise NotImplementedError(f"{type(self).__name__} must implement start(task)")

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Run one tool call and return its result text (the ``tool`` message)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement call_tool(name, arguments)"
        )

    def grade(self, answer: str) -> float:
        """The reward in [0, 1] for a final ``answer`` to the current task."""
        raise NotImplementedError(f"{type(self).__name__} must implement grade(answer)")

    def plan(self) -> list[str]:
        return []

    def random_call(self, np_random: np.random.Generator) -> str:
        """A plausible random tool call for ``sample_action`` (override per env)."""
        schema = self.tools[int(np_random.integers(len(self.tools)))]["function"]
        return format_tool_call(schema["name"], {})

    # ----------------------------------------------------------------- TextEnv
    def _system_prompt(self) -> str:
        ending = (
            "Each result comes back as a tool message. When you know the answer, write it as "
            "<answer>...</answer>; that ends the episode."
        )
        if not self._describing:  # the chat template lists the tools and how to call them
            return f"{self.intro}\n{ending}"
        listing = "\n".join(json.dumps(tool["function"], sort_keys=True) for tool in self.tools)
        return (
            f"{self.intro}\nYou can call these tools:\n{listing}\n{self.parser.instructions} "
            + ending
        )

    def on_reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        describing = _flag(options.get("describe_tools", self.describe_tools), "describe_tools")
        if describing != self._describing:
            self._describing = describing
            self.system_prompt = self._system_prompt()
        self.task = self.tasks.select(
            options, self.np_random, required=self.required_fields, generated=self.generated_fields
        )
        self.question = self.start(self.task)
        self._plan = self.plan()
        self._plan_position = 0
        return self.question, {"task_id": self.task["id"]}

    def _outside_calls(self, text: str) -> str:
        """``text`` without its tool-call blocks (an ``<answer>`` in a call's arguments is the
        call's)."""
        tag = re.escape(self.parser.tag)
        return re.sub(rf"<{tag}>.*?(?:</{tag}>|$)", " ", text, flags=re.DOTALL | re.IGNORECASE)

    def on_step(self, action: str) -> Turn:
        return self.on_message({"role": "assistant", "content": action})

    def on_message(self, message: Message) -> Turn:
        """A reply as text (its calls in ``<tool_call>`` tags) or as an assistant message whose
        ``tool_calls`` are data (their ids answer in the tool messages); checked alike."""
        action = message_text(message)
        if self._plan_position < len(self._plan) and action == self._plan[self._plan_position]:
            self._plan_position += 1
        try:
            calls = self.parser.parse_message(message)
        except ActionParseError as error:
            return self.invalid_action(error.feedback)
        if calls:
            messages = [self._run(call) for call in calls]
            errors = sum(message["content"].startswith("Error:") for message in messages)
            if extract_answer(self._outside_calls(action)) is not None:  # said, not dropped
                messages.append({"role": "user", "content": ANSWER_WITH_CALLS})
            return Turn(
                messages, info={"tool_calls": [c.name for c in calls], "tool_errors": errors}
            )
        answer = extract_answer(action)
        if answer is None:
            return self.invalid_action(
                "I found neither a tool call nor an answer. "
                + self.parser.instructions
                + " Or give your final answer as <answer>...</answer>."
            )
        score = float(min(1.0, max(0.0, self.grade(answer))))
        verdict = "correct" if score >= 1.0 else ("partly correct" if score > 0 else "incorrect")
        return Turn(
            f"Your answer {answer[:200]!r} is {verdict}.",
            reward=score,
            terminated=True,
            success=score >= 1.0,
            info={"answer": answer[:200], "score": score},
        )

    def _run(self, call: ToolCall) -> Message:
        try:
            result = self.call_tool(call.name, call.arguments)
        except ToolError as error:
            result = f"Error: {error}"
        return {
            "role": "tool",
            "name": call.name,
            "tool_call_id": call.id,
            "content": truncate(str(result), self.max_tool_chars),
        }

    def expert_action(self) -> str | None:
        if self.done or not self._plan:
            return None
        return self._plan[min(self._plan_position, len(self._plan) - 1)]

    def sample_action(self, np_random: np.random.Generator) -> str:
        roll = np_random.random()
        if roll < 0.6 and self.tools:
            return self.random_call(np_random)
        if roll < 0.75:
            return (
                '<tool_call>{"name": "'
                + str(self.tools[0]["function"]["name"] if self.tools else "x")
                + '", "arguments": {</tool_call>'
            )
        if roll < 0.85:
            return "I am thinking about it."
        return f"<answer>{int(np_random.integers(0, 1000))}</answer>"
