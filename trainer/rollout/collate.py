"""How trajectories become a training batch.

``collate`` pads trajectories (right padding) into the tensors every algorithm uses::

    input_ids      (B, T) long    attention_mask (B, T) long    response_mask (B, T) float
    old_logprobs   (B, T) float   token_rewards  (B, T) float   scores        (B,)   float
    group_ids      (B,)   long    episode_ids    (B,)   long

``token_rewards`` holds each turn's reward on that turn's last policy token (the final reward
on the episode's last one); ``scores`` is the episode return. Episodes from env workers
(``trainer.rollout.wire.PackedTrajectory``) are read from their packed bytes
(``Trajectory.token_array``). ``episode_advantages`` maps a batch's advantages back to
episodes; ``turn_states`` gives GiGPO its per-turn states.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from trainer.rollout.trajectory import Trajectory

if TYPE_CHECKING:
    import torch

__all__ = ["collate", "episode_advantages", "turn_states"]


def episode_advantages(
    trajectories: Sequence[Trajectory], advantages: torch.Tensor
) -> list[list[float]]:
    """Per episode, the advantage of each token of its rows (concatenated), from the ``(B, T)``
    advantages of the batch ``collate(trajectories)`` built."""
    out: list[list[float]] = []
    r = 0
    for trajectory in trajectories:
        values: list[float] = []
        for row in trajectory.rows:
            values += advantages[r, : len(row.token_ids)].tolist()
            r += 1
        out.append(values)
    return out


def collate(
    trajectories: Sequence[Trajectory],
    pad_token_id: int,
    step_gamma: float | None = None,
    *,
    mask_truncated: bool = False,
) -> dict[str, torch.Tensor]:
    """Right-padded training tensors for ``trajectories`` (shapes in the module docstring).

    An episode with ``samples`` (one per turn, or per agent call that did not extend the last
    one) gives one row per sample, in their order: each turn's reward on that turn's last
    policy token, the final reward beside the episode's last turn reward (on the last sample
    that ended a turn), and the episode return as every row's score; ``episode_ids`` (B,)
    says which episode a row came from, so group baselines count each episode once however
    many turns it took, and GAE and Reinforce++ credit a row with its episode's later rows
    (``trainer.algos.advantages.later_returns``, discounted as one row would be). With
    samples and ``step_gamma`` (GiGPO's discount; only GiGPO asks), ``state_ids`` and
    ``step_returns`` (B,) are its inputs (``turn_states``). ``mask_truncated``
    (``algorithm.mask_truncated``): the rows of an episode that was cut short have an all-zero
    ``response_mask`` (nothing of them is trained) and keep their score (group baselines)."""
    import torch

    dtypes = {"q": torch.int64, "i": torch.int32, "b": torch.int8, "d": torch.float64}
    rows = [(i, k, row) for i, t in enumerate(trajectories) for k, row in enumerate(t.rows)]
    # each row's lists as arrays (a row from an env worker: straight from its packed bytes,
    # never one Python object per token), each copied into its tensor row at once
    arrays = [
        [row.token_array(n) for n in ("token_ids", "response_mask", "logprobs")]
        for _, _, row in rows
    ]
    width = max(len(ids) for ids, _, _ in arrays)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    response_mask = torch.zeros((len(rows), width))
    old_logprobs = torch.zeros((len(rows), width))
    # each turn's reward on its last policy token, and the final reward beside the episode's
    # last one (the later rows' rewards reach a sample's row through the estimators)
    last_row = {i: r for r, (i, _, row) in enumerate(rows) if row.turn_ends}
    at_rows: list[int] = []
    at_tokens: list[int] = []
    rewards: list[float] = []
    for r, (i, _, row) in enumerate(rows):
        episode, n = trajectories[i], len(arrays[r][0])
        if n:
            for tensor, values in zip(
                (input_ids, response_mask, old_logprobs), arrays[r], strict=True
            ):
                tensor[r, :n] = torch.frombuffer(values, dtype=dtypes[values.typecode])
        attention_mask[r, :n] = 1
        if mask_truncated and episode.truncated:
            response_mask[r] = 0.0
        if len(row.turn_ends) != len(row.turn_rewards):
            raise ValueError(
                f"a trajectory of {row.env_id!r} has {len(row.turn_rewards)} turn rewards for "
                f"{len(row.turn_ends)} turn ends; record each turn with end_turn(reward)"
            )
        if not row.turn_ends:
            continue
        ends, earned = list(row.turn_ends), list(row.turn_rewards)
        if last_row[i] == r:
            ends, earned = [*ends, ends[-1]], [*earned, episode.final_reward]
        at_rows += [r] * len(ends)
        at_tokens += ends
        rewards += earned
    token_rewards = torch.zeros((len(rows), width))
    token_rewards.index_put_(
        (torch.tensor(at_rows, dtype=torch.long), torch.tensor(at_tokens, dtype=torch.long)),
        torch.tensor(rewards, dtype=torch.float32),
        accumulate=True,
    )
    episodes = [trajectories[i] for i, _, _ in rows]
    out = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "old_logprobs": old_logprobs,
        "token_rewards": token_rewards,
        "scores": torch.tensor([t.episode_reward for t in episodes], dtype=torch.float32),
        "group_ids": torch.tensor([t.group_id for t in episodes], dtype=torch.long),
        "episode_ids": torch.tensor([i for i, _, _ in rows], dtype=torch.long),
    }
    if step_gamma is not None and any(row is not trajectories[i] for i, _, row in rows):
        states, returns = turn_states(trajectories, step_gamma)
        out["state_ids"] = torch.tensor(states, dtype=torch.long)
        out["step_returns"] = torch.tensor(returns, dtype=torch.float32)
    return out


def turn_states(
    trajectories: Sequence[Trajectory], gamma: float = 1.0
) -> tuple[list[int], list[float]]:
    """Per training row (in ``collate``'s order): the env state its turn answered, as an id
    (rows that answered the same state share it), and the turn's discounted return to the end
    of its episode (``r_t + gamma * r_t+1 + ...``, the final reward on the last turn).

    The state a turn answered is what the env said since the policy's previous turn (the
    transcript's messages; for the first turn the system prompt and the task). A row that
    cannot be matched to one turn - an episode trained as one sequence, or an agent's run of
    calls (``trainer.rollout.proxy``) - is a state of its own, with the episode's return."""
    ids: dict[object, int] = {}
    states: list[int] = []
    returns: list[float] = []
    for episode in trajectories:
        observations = _observations(episode.messages)
        matched = bool(episode.samples) and len(observations) == len(episode.samples)
        rewards = [sum(sample.turn_rewards) for sample in episode.samples]
        if rewards:
            rewards[-1] += episode.final_reward
        to_go = [0.0] * len(rewards)
        running = 0.0
        for t in reversed(range(len(rewards))):
            running = rewards[t] + gamma * running
            to_go[t] = running
        for k, _row in enumerate(episode.rows):
            key: object = observations[k] if matched else ("row", len(states))
            states.append(ids.setdefault(key, len(ids)))
            returns.append(to_go[k] if matched else episode.episode_reward)
    return states, returns


def _observations(messages: Sequence[dict[str, Any]]) -> list[str]:
    """Per assistant message of a transcript, the other messages since the previous one (what
    the policy answered), as canonical text."""
    seen: list[str] = []
    current: list[tuple[Any, Any]] = []
    for message in messages:
        if message.get("role") == "assistant":
            seen.append(json.dumps(current, sort_keys=True, default=str))
            current = []
        else:
            current.append((message.get("role"), message.get("content")))
    return seen
