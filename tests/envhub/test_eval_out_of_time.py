"""``envhub eval`` when an episode runs past ``--episode-timeout``: the side whose call hung is
charged, whatever the other side used before; a record of the old form (an ``episode_timeout``
that meant any timeout) is still replayed by ``--resume``; and the abandoned episode stops,
sending no more requests and stepping its env no more. The charged side is read off a clock
the test moves (``EpisodeClock(now=...)``); every wait for another thread is on an ``Event``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openai", reason="needs the openai extra: pip install -e '.[openai]'")
pytest.importorskip("fastapi", reason="needs the server extra: pip install -e '.[server]'")

import openai
import orjson

import envhub
from envhub.eval_records import EpisodeStats, read_episodes, summarise
from envhub.eval_workers import EpisodeClock, _out_of_time
from envhub.evaluation import evaluate
from tests.envhub.openai_servers import completion, scripted_server
from tests.helpers import CountdownEnv

RELEASE = threading.Event()
"""Set at the end of each test: lets a hung env call or a stalled reply return."""
CLOSED = threading.Event()
"""Set when an env of this module is closed (the abandoned worker closes its env as it ends)."""
STEPS: list[int] = []
"""The turn number of every env ``step`` as it starts."""


def turn_of(body: dict[str, Any]) -> int:
    """The episode's turn a chat request asks for (from 0): the replies it already holds."""
    return sum(message["role"] == "assistant" for message in body["messages"])


class Stepped(CountdownEnv):
    """A countdown that records each step as it starts (``STEPS``) and says when it is closed."""

    def on_reset(self, options: dict[str, Any]) -> Any:
        self.steps = 0
        return super().on_reset(options)

    def on_step(self, action: str) -> Any:
        self.steps += 1
        STEPS.append(self.steps)
        self.take_time(self.steps)
        return super().on_step(action)

    def take_time(self, step: int) -> None:
        """What the ``step``-th step (from 1) does before it answers."""

    def on_close(self) -> None:
        CLOSED.set()


class HangsOnSecondStep(Stepped):
    """Its 2nd step does not return until the test sets ``RELEASE`` (a dead sandbox)."""

    def take_time(self, step: int) -> None:
        if step == 2:
            RELEASE.wait()


HANGS, STEPPED = "evaltime/hangs-second-v0", "evaltime/stepped-v0"
for _id, _entry in {HANGS: HangsOnSecondStep, STEPPED: Stepped}.items():
    envhub.register(_id, _entry, max_turns=5)


@pytest.fixture(autouse=True)
def release_what_waits() -> Iterator[None]:
    RELEASE.clear()
    CLOSED.clear()
    STEPS.clear()
    yield
    RELEASE.set()


# ------------------------------------------------------------- whose call hung is charged
def clock_of(*calls: tuple[str, float]) -> tuple[EpisodeClock, list[float]]:
    """A clock on a counter of seconds that ``calls`` (side, seconds) have run on, one by one."""
    now = [0.0]
    clock = EpisodeClock(now=lambda: now[0])
    for side, seconds in calls:
        with clock.timing(side):  # type: ignore[arg-type]
            now[0] += seconds
    return clock, now


@pytest.mark.parametrize(
    ("before", "hung", "reason", "call"),
    [
        ("agent", "env", "env_timeout", "in the env's call, under way for 0.9 s"),
        ("env", "agent", "episode_timeout", "in the agent's turn, under way for 0.9 s"),
    ],
)
def test_the_side_whose_call_hung_is_charged_whatever_the_other_used_before(
    before: str, hung: str, reason: str, call: str
) -> None:
    """One side used most of the 3 s (two slow calls), then the other side's call hangs: the
    hang is the episode's cause, and its side is charged."""
    clock, now = clock_of((before, 1.0), (hung, 0.05), (before, 1.05))
    with clock.timing(hung):  # type: ignore[arg-type]
        now[0] += 0.9  # (the call under way when the episode runs out of time)
        charged, detail = _out_of_time(clock, 3.0)
    assert charged == reason
    assert call in detail and "in all: the agent's turns" in detail  # the totals too


def test_between_two_calls_the_side_that_used_most_of_the_time_is_charged() -> None:
    clock, _ = clock_of(("env", 2.0), ("agent", 0.5))
    assert _out_of_time(clock, 3.0)[0] == "env_timeout"
    clock, _ = clock_of(("env", 0.5), ("agent", 2.0))
    assert _out_of_time(clock, 3.0)[0] == "episode_timeout"


# ----------------------------------------------------------- records of the old form
OLD_DETAIL = (
    "the episode ran past --episode-timeout 900 s; its thread was abandoned and its env is "
    "not reused"
)
"""What envhub wrote for every episode out of time before it told the sides apart."""


def timed_out(seed: int, detail: str) -> EpisodeStats:
    return EpisodeStats(
        env_id=STEPPED, seed=seed, episode_return=0.0, turns=0, success=False,
        invalid_actions=0, truncated=False, seconds=900.0, agent="random",
        failure="episode_timeout", detail=detail,
    )  # fmt: skip


@pytest.mark.timeout(60)
def test_resume_replays_an_old_episode_timeout_and_keeps_a_new_one(tmp_path: Path) -> None:
    """An ``episode_timeout`` written before the sides were told apart meant any timeout, a
    hung env's included: it is not counted as measured, and ``--resume`` plays it again; one
    written since (here in the first wording that told the sides apart) is the agent's,
    measured and kept."""
    new_detail = (
        "the episode ran past --episode-timeout 900 s, 600.0 s of it in the agent's turns; its "
        "thread was abandoned and its env is not reused"
    )
    lines = [timed_out(0, OLD_DETAIL), timed_out(1, new_detail)]
    (tmp_path / "episodes.jsonl").write_bytes(
        b"".join(orjson.dumps(e.as_record()) + b"\n" for e in lines)
    )
    before = summarise(STEPPED, "random", read_episodes(tmp_path / "episodes.jsonl"))
    assert before.measured == 1  # the old record is left out, as it was when it was written

    [after] = evaluate([STEPPED], ["random"], episodes=2, out=tmp_path, resume=True)
    by_seed = {e.seed: e for e in read_episodes(tmp_path / "episodes.jsonl")}
    assert by_seed[0].failure is None and by_seed[0].turns > 0  # played again
    assert by_seed[1].failure == "episode_timeout"  # the agent's: kept
    assert after.failures == {"episode_timeout": 1} and after.measured == 2


# ------------------------------------------------------------ an abandoned episode stops
@pytest.mark.timeout(60)
@pytest.mark.parametrize("hung", ["env", "model"])
def test_an_abandoned_episode_sends_no_more_requests_and_steps_its_env_no_more(
    hung: str,
) -> None:
    """The env's 2nd step hangs, or the server stalls on the 2nd request, past the timeout:
    once ``evaluate`` has recorded the episode failed, the call that hung may return, but the
    episode plays no further turn: no request reaches the server, no step the env."""

    def reply(body: dict[str, Any]) -> dict[str, Any]:
        if hung == "model" and turn_of(body) == 1:
            RELEASE.wait()
        return completion("nope")

    env_id = HANGS if hung == "env" else STEPPED
    with scripted_server(reply, ("m",), blocking=True) as server:
        client = openai.OpenAI(base_url=server.url, api_key="test", max_retries=0, timeout=60)
        [summary] = evaluate([env_id], client=client, episodes=1, episode_timeout=1.0)
        assert sum(summary.failures.values()) == 1, summary.failures
        requests, steps = len(server.requests), list(STEPS)
        RELEASE.set()  # the hung call returns
        assert CLOSED.wait(30), "the abandoned episode did not end"
        assert len(server.requests) == requests, "a request after the episode was given up"
    assert STEPS == steps, "the env was stepped after the episode was given up"
