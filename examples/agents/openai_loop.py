"""An agent written against the plain ``openai`` SDK, trained with ``envhub train``.

    envhub train examples/quickstart.yaml \
        rollout.agent.callable=examples.agents.openai_loop:run_agent

It is the usual chat loop of any harness: ask the model, act with its reply (its text, or its
tool calls when the env has tools), append the reply and the env's answer, repeat. Nothing in it
is envhub-specific but the ``AgentEpisode`` it is handed. Run as a program it reads the episode
from the environment the trainer sets (``rollout.agent.command``).
"""

from __future__ import annotations

from typing import Any

from trainer.rollout.agents import AgentEpisode


def run_agent(episode: AgentEpisode) -> None:
    """Play one episode: the model's reply is the action until the env ends the episode."""
    client = episode.openai_client()  # the SDK's retries on, as in any harness
    messages: list[dict[str, Any]] = list(episode.messages)
    tools = {"tools": episode.tools} if episode.tools else {}
    while True:
        reply = (
            client.chat.completions.create(model=episode.model, messages=messages, **tools)
            .choices[0]
            .message
        )
        step = episode.env.step(reply)  # text, or tool calls as envhub's <tool_call> text
        messages += [reply.model_dump(exclude_none=True), *step.messages]
        if step.done:
            return


def main() -> None:
    """``rollout.agent.command: python examples/agents/openai_loop.py``: the same agent as a
    program (the trainer sets ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` for it)."""
    run_agent(AgentEpisode.from_environ())


if __name__ == "__main__":
    main()
