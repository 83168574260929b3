"""The driver's cost of turning a training batch's trajectories into tensors (``collate``).

    python benchmarks/collate.py                      # 2,000 episodes of ~770 tokens
    python benchmarks/collate.py --episodes 10000

Episodes like ``rollout_scale.py``'s (tokens per episode ~ LogNormal(median ``--tokens``,
sigma 0.9), a context run then a policy run per turn, 3 turns), built in this process and
sent through the env workers' wire (``trainer.rollout.wire``: a finished episode reaches the
driver with its per-token lists packed, as in a run with ``rollout.env_workers``). Times
``trainer.rollout.collate.collate`` over the batch, best of ``--repeats``, in this
process's CPU time. Last line ``collate_us_per_episode: X us``.
"""

from __future__ import annotations

import argparse
import pickle
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def episodes(count: int, median_tokens: float, seed: int = 0) -> list[object]:
    from trainer.rollout.trajectory import Trajectory
    from trainer.rollout.wire import trajectory_from_wire, trajectory_to_wire

    rng = random.Random(seed)
    out = []
    for index in range(count):
        tokens = max(6, min(8192, round(rng.lognormvariate(0.0, 0.9) * median_tokens)))
        trajectory = Trajectory("bench", index, index // 8)
        for turn in range(3):
            context, policy = tokens // 6, tokens // 6
            trajectory.append_context([rng.randrange(32_000) for _ in range(context)])
            trajectory.append_policy(
                [rng.randrange(32_000) for _ in range(policy)], [-0.5] * policy, version=turn
            )
            trajectory.end_turn(1.0)
        wire = pickle.dumps(trajectory_to_wire(trajectory), protocol=pickle.HIGHEST_PROTOCOL)
        out.append(trajectory_from_wire(pickle.loads(wire)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=2000)
    parser.add_argument("--tokens", type=float, default=770.0, help="median tokens per episode")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from trainer.rollout.collate import collate

    batch = episodes(args.episodes, args.tokens)
    best = float("inf")
    for _ in range(args.repeats):
        fresh = pickle.loads(pickle.dumps(batch))  # packed again, as each batch arrives
        started = time.process_time()
        collate(fresh, pad_token_id=0)
        best = min(best, time.process_time() - started)
    tokens = sum(len(t.token_ids) for t in batch) / len(batch)  # type: ignore[attr-defined]
    print(f"{args.episodes} episodes of {tokens:.0f} tokens on average: collate {best:.3f} s")
    print(f"collate_us_per_episode: {1e6 * best / args.episodes:.1f} us")


if __name__ == "__main__":
    main()
