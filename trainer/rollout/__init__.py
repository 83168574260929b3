"""Rollouts, one path for every ``rollout.mode``:

``rollouts``     ``Rollouts``: what the pipeline calls (next batch, eval set, weight updates,
                 off-policy correction, checkpoint state) over the loop thread below
``scheduler``    ``RolloutScheduler``: every group's lifecycle (start, replay, filter, staleness,
                 batch), and ``LoopThread``
``router``       ``EngineRouter``: least-loaded sticky routing, aborts, preemption, over the
                 engines; ``RolloutEngine``: what the rollout path needs of an engine
``env_manager``  one episode against one env (template -> tokens -> generate -> step), env sources
``env_workers``  ``EnvWorkers``: env managers in worker processes (``rollout.env_workers``);
                 ``env_worker_process``: one such process (its loop, ``RemoteEngine``, messages)
``agents``       ``rollout.agent``: a black-box agent plays each episode (``AgentEpisode``)
``proxy``        the OpenAI-compatible endpoint it plays through, recording exact tokens
``groups``       which episodes a step or an evaluation plays; ``play_episode`` (replays on failure)
``trajectory``   episodes as token sequences with masks, log-probs and versions; chat rendering
``collate``      a batch of episodes as the padded training tensors
``wire``         the driver <-> env worker frames and encodings (packed finished episodes)
"""

from __future__ import annotations

__all__ = [
    "agents",
    "collate",
    "env_manager",
    "env_worker_process",
    "env_workers",
    "groups",
    "proxy",
    "rollouts",
    "router",
    "scheduler",
    "trajectory",
    "wire",
]
