"""Agents written with only the ``openai`` SDK, as a user would, for the proxy tests.

``play`` is the loop of ``trainer.rollout.agents``' docstring; the others misbehave on purpose.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

import openai

from trainer.rollout.agents import AgentEpisode

HANG = threading.Event()
"""``hangs`` waits on this (set by a test's teardown so abandoned threads end)."""


def _reply(client: openai.OpenAI, episode: AgentEpisode, messages: list[dict[str, Any]]) -> Any:
    tools = {"tools": episode.tools} if episode.tools else {}
    completion = client.chat.completions.create(model=episode.model, messages=messages, **tools)
    return completion.choices[0].message


def play(episode: AgentEpisode) -> None:
    """Call the model, act with its reply, append both, until the env ends the episode."""
    client = openai.OpenAI(  # plain HTTP on loopback: no TLS context to build per episode
        base_url=episode.base_url,
        api_key=episode.api_key,
        max_retries=0,
        http_client=openai.DefaultHttpxClient(verify=False),
    )
    messages = list(episode.messages)
    while True:
        reply = _reply(client, episode, messages)
        step = episode.env.step(reply)
        messages += [reply.model_dump(exclude_none=True), *step.messages]
        if step.done:
            return


def answer(episode: AgentEpisode) -> str:
    """One model call; its text is the final answer (the trainer plays it as the last action)."""
    client = episode.openai_client(max_retries=0)
    return str(_reply(client, episode, list(episode.messages)).content or "")


def raises(episode: AgentEpisode) -> None:
    client = episode.openai_client(max_retries=0)
    _reply(client, episode, list(episode.messages))
    raise ValueError("the agent's own bug")


def hangs(episode: AgentEpisode) -> None:
    HANG.wait()


def returns_a_number(episode: AgentEpisode) -> int:
    client = episode.openai_client(max_retries=0)
    _reply(client, episode, list(episode.messages))
    return 7


CLIENTS: list[Any] = []
"""The clients ``keeps_its_client`` got (a test checks they were closed with the episode)."""


def keeps_its_client(episode: AgentEpisode) -> str:
    """``answer``, keeping the client ``openai_client`` gave it in ``CLIENTS``."""
    client = episode.openai_client(max_retries=0)
    CLIENTS.append(client)
    return str(_reply(client, episode, list(episode.messages)).content or "")


def steps(episode: AgentEpisode) -> None:
    """One model call through ``openai_client``, acted on through ``episode.env``."""
    client = episode.openai_client(max_retries=0)
    episode.env.step(_reply(client, episode, list(episode.messages)))


async def answers_async(episode: AgentEpisode) -> str:
    """``answer`` as an ``async def`` agent (``openai.AsyncOpenAI``, LangGraph, ...)."""
    async with openai.AsyncOpenAI(
        base_url=episode.base_url, api_key=episode.api_key, max_retries=0
    ) as client:
        tools = {"tools": episode.tools} if episode.tools else {}
        completion = await client.chat.completions.create(
            model=episode.model, messages=list(episode.messages), **tools
        )
    return str(completion.choices[0].message.content or "")


def forgetful(episode: AgentEpisode) -> None:
    """Keeps no history: each call sends the first messages and the env's latest reply only,
    so no call extends the one before (each is a sample of its own)."""
    client = episode.openai_client(max_retries=0)
    messages = list(episode.messages)
    while True:
        reply = _reply(client, episode, messages)
        step = episode.env.step(reply)
        if step.done:
            return
        messages = [*episode.messages, *step.messages]


def main() -> None:
    """``python -m tests.trainer.rollout.proxy_agents [fail|orphan|noisy]``: ``play`` as a
    program agent. ``fail`` exits 3; ``orphan`` plays one turn, starts a child that holds its
    stderr (pid in ``$ORPHAN_PID_FILE``) and exits 0; ``noisy`` logs 32 MB and exits 3."""
    mode = sys.argv[1:2]
    if mode == ["fail"]:
        print("cannot reach the model", file=sys.stderr)
        raise SystemExit(3)
    if mode == ["noisy"]:
        for _ in range(32 * 1024):
            sys.stderr.write("debug: " + "x" * 1016 + "\n")
        print("the last words", file=sys.stderr)
        raise SystemExit(3)
    episode = AgentEpisode.from_environ()
    if mode != ["orphan"]:
        play(episode)
        return
    client = episode.openai_client(max_retries=0)
    episode.env.step(_reply(client, episode, list(episode.messages)))
    child = subprocess.Popen(["sleep", "60"])  # a helper (a tool server, say); inherits stderr
    with open(os.environ["ORPHAN_PID_FILE"], "w") as out:
        out.write(str(child.pid))


if __name__ == "__main__":
    main()
