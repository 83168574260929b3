"""One agent episode's recording on the proxy (``trainer.rollout.proxy``): its samples (token
rows), the calls that wrote them, and which call a step's reward goes to.

Guarantees (what ``AgentProxy`` relies on, and through it the trainer):

1. **Only replies the agent received are trained, each once.** A call is recorded
   (``record``) only once its generation is back and its client is still there (the HTTP side
   cancels a call whose client went away, and nothing is recorded: ``abandon`` notes it). A
   reply can still be sent to a client that has just given up; the ``openai`` SDK then retries
   the same request with ``x-stainless-retry-count`` > 0, and ``retract`` takes the unreceived
   reply back (its tokens, its turn of ``rollout.max_turns``) before the retry is recorded;
   unless an abandoned call with the same messages is waiting for its retry: that is the call
   retried, and the latest reply (an identical call's, best-of-n, that the agent holds) stays.
2. **A step's reward goes to the reply the agent acted on** (``credited``): among the calls
   since the last step, the latest whose reply is the action (the env's text of it, so a text
   action or the reply message both match); with no match, the one call since the last step
   (an agent may act on an edited reply, or its final answer drawn from it); with no match
   among several, no row: a reply the agent discarded is never credited (the reward still
   counts in the episode's return). A step with no call since the last steps on the same call.
3. **The next call extends the conversation the agent kept**: the latest call, or the one a
   step credited, if its row ends with it.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from envhub.tool_calls import ToolCall
from trainer.rollout.chat_messages import same_message

if TYPE_CHECKING:
    from trainer.rollout.env_manager import EnvSession, Sampling
    from trainer.rollout.trajectory import Trajectory

__all__ = ["ProxyCall", "ProxyEpisode"]


@dataclass
class ProxyCall:
    """One recorded model call: where its tokens went and the conversation it leaves."""

    row: Trajectory
    start: int
    """``len(row.token_ids)`` before the call appended its context and generation."""
    end: int
    """``len(row.token_ids)`` after: its generation's last token is ``end - 1``."""
    new_row: bool
    seen: list[dict[str, Any]]
    """The call's messages and the reply the proxy gave."""
    tools: str
    """The call's tools (JSON, keys sorted): a call extends this one only with the same."""
    stopped_on_eos: bool
    action: str
    """The reply as the env reads an action (``message_text``): what a step is matched on."""
    before: ProxyCall | None = None
    """The call a next call extended before this one was recorded (restored by ``retract``)."""
    versions: int = 1
    """Entries it added to ``policy_versions`` (a call a weight update preempted adds one per
    part): what ``retract`` takes back."""


@dataclass
class ProxyEpisode:
    """One episode's recording: its samples (token rows) and the calls that wrote them."""

    key: str
    """The episode key: request ids are ``{key}/{call}`` (router stickiness and aborts)."""
    api_key: str
    trajectory: Trajectory
    session: EnvSession
    sampling: Sampling
    tools: list[dict[str, Any]] | None
    """The env's tool schemas (from its reset info)."""
    first_messages: list[dict[str, Any]]
    info: dict[str, Any] = field(default_factory=dict)
    """The env's latest info (``max_new_tokens`` caps the next call)."""
    rows: list[Trajectory] = field(default_factory=list)
    calls: int = 0
    """Model calls recorded (a retracted one no longer counts): ``rollout.max_turns`` bounds it."""
    env_done: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    generating: str | None = None
    """The request id of the call in the engine now (aborted when the episode closes)."""
    generations: int = 0
    """Generations started: request ids are ``{key}/{n}``, never reused in the episode."""
    last: ProxyCall | None = None
    """The call a next call may extend (guarantee 3)."""
    pending: list[ProxyCall] = field(default_factory=list)
    """The calls since the last step (guarantee 2)."""
    latencies: list[float] = field(default_factory=list)
    """Seconds per call, engine included."""
    abandoned: list[tuple[list[dict[str, Any]], str]] = field(default_factory=list)
    """Messages and tools of calls whose client went away before their reply, which no retry
    has claimed yet (guarantee 1; the latest 16, and none from before the last step)."""
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def call_id(self) -> str:
        """A tool-call id no other call of this episode has, numbered (``call00000``,
        ``call00001``, ...: ``ToolCall.numbered_id``, 9 letters and digits as Mistral's
        template requires), so a replayed episode gets the same ids."""
        return ToolCall.numbered_id(next(self._ids))

    def named_calls(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A step's ``calls``, each with an id: one given keeps it, one without gets the next
        ``call_id()`` that no call of ``calls`` has (ids are unique in a step: ``step_action``)."""
        given = {call.get("id") for call in calls}
        named = []
        for call in calls:
            if not call.get("id"):
                new_id = self.call_id()
                while new_id in given:
                    new_id = self.call_id()
                call = {**call, "id": new_id}
            named.append(call)
        return named

    def record(self, call: ProxyCall, latency: float) -> None:
        """``call`` has written its tokens into ``call.row`` and its reply went out."""
        call.before = self.last
        if call.new_row:
            self.rows.append(call.row)
        self.calls += 1
        self.last = call
        self.pending.append(call)
        self.latencies.append(latency)

    def abandon(self, messages: list[dict[str, Any]], tools: str) -> None:
        """A call with ``messages`` and ``tools`` was given up before its reply (its client
        went away): an SDK retry of it is a retry of this, not of a delivered call."""
        self.abandoned = [*self.abandoned[-15:], (messages, tools)]

    def retract(self, messages: list[dict[str, Any]], tools: str) -> bool:
        """A retry with ``messages`` and ``tools`` is asking again (guarantee 1): the abandoned
        call it retries, if one had them, is settled and nothing taken back; else the latest
        call is taken back if it is the last recorded, not stepped on, nothing was appended
        after it, and it had ``messages`` and ``tools``. Returns whether a call was taken back."""
        for i, (asked, asked_tools) in enumerate(self.abandoned):
            if asked_tools == tools and _same(asked, messages):
                del self.abandoned[i]
                return False
        call = self.pending[-1] if self.pending else None
        if (
            call is None
            or call is not self.last
            or call.tools != tools
            or len(call.row.token_ids) != call.end
            or not _same(messages, call.seen[:-1])
        ):
            return False
        row = call.row
        for values in (row.token_ids, row.response_mask, row.logprobs, row.token_versions):
            del values[call.start :]
        if call.new_row:
            self.rows.remove(row)
        self.pending.pop()
        self.last, self.calls = call.before, self.calls - 1
        del self.trajectory.policy_versions[len(self.trajectory.policy_versions) - call.versions :]
        del self.latencies[-1:]
        return True

    def credited(self, action: str) -> ProxyCall | None:
        """The call a step with ``action`` (env text) rewards (guarantee 2); the calls since the
        last step are settled."""
        pending, self.pending, self.abandoned = self.pending, [], []
        if not pending:
            return self.last
        matching = [call for call in pending if call.action == action]
        call = matching[-1] if matching else pending[0] if len(pending) == 1 else None
        if call is not None and len(call.row.token_ids) == call.end:
            self.last = call
        return call

    def end(self, failure: str | None = None) -> None:
        """No more calls or steps (410 from now on); ``failure`` fails the episode."""
        if failure is not None and not self.trajectory.failed:
            self.trajectory.failed, self.trajectory.failure = True, failure[:500]
        self.ended.set()

    def finish(self) -> Trajectory:
        """The episode for the scheduler: one row is the episode's own token sequence, several
        become its ``samples``; rows without a sampled token are dropped, and an episode left
        without any cannot be trained on (failed). Ends the episode: nothing writes into the
        rows or the trajectory after this (a late call or step answers 410)."""
        self.end()
        t = self.trajectory
        rows = [row for row in self.rows if any(row.response_mask)]
        if not rows and not t.failed:
            t.failed = True
            t.failure = (
                "the agent made no model call"
                if not self.rows
                else "no model call sampled a token (every generation was empty)"
            )
        if len(rows) == 1:
            row = rows[0]
            t.token_ids, t.response_mask = list(row.token_ids), list(row.response_mask)
            t.logprobs, t.token_versions = list(row.logprobs), list(row.token_versions)
            t.turn_ends, t.turn_rewards = list(row.turn_ends), list(row.turn_rewards)
            t.prompt_length = row.prompt_length
        elif rows:
            t.samples = rows
            t.prompt_length = rows[0].prompt_length
        return t


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Whether two conversations say the same, message by message (``same_message``)."""
    return len(a) == len(b) and all(same_message(x, y) for x, y in zip(a, b, strict=True))
