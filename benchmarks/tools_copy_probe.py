"""Has a tools-quickstart warm start learnt to copy? Teacher-forced greedy accuracy of a policy on
noise-free expert episodes of `tools/lookup-v0`.

The tool quickstart learns only when its warm start can copy the names from the question into
the `lookup` calls and the codes from the tool messages into the answer. This feeds a policy
the expert's episodes (the same chat template and tokens the trainer uses) and checks whether
its most likely next token is the expert's at every policy token after the first move (the
first move is the sloppy demonstrator's coin flip: guess or look up). Prints the tokens it
gets wrong most often. Last line: ``tools_copy_episode_acc: X`` (episodes right to the token).

    envhub train examples/tools-quickstart.yaml train.steps=0 output_dir=runs/probe seed=S
    python benchmarks/tools_copy_probe.py runs/probe/final_policy [--episodes 200]
"""

from __future__ import annotations

import argparse
import collections


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.rollout.trajectory import ChatRenderer
    from trainer.sft import expert_trajectories

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policy", help="an HF policy folder (a run's final_policy)")
    parser.add_argument("--episodes", type=int, default=200)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.policy)
    model = AutoModelForCausalLM.from_pretrained(args.policy).eval()
    demos = expert_trajectories(
        ["tools/lookup-v0"],
        {"max_turns": 4},
        ChatRenderer(tokenizer),
        episodes=args.episodes,
        max_turns=4,
        seed=99,
        seed_offset=1_400_000_000,  # tasks apart from training's and eval's
    )
    right = total = whole = 0
    misses: collections.Counter[tuple[str, str]] = collections.Counter()
    for demo in demos:
        ids, mask = demo.token_ids, demo.response_mask
        with torch.no_grad():
            guess = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
        starts = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
        second_move = starts[1] if len(starts) > 1 else len(mask)
        ok = True
        for i in range(second_move, len(mask)):
            if mask[i]:
                total += 1
                hit = guess[i - 1] == ids[i]
                right += hit
                ok &= hit
                if not hit:
                    misses[(tokenizer.decode([ids[i]]), tokenizer.decode([guess[i - 1]]))] += 1
        whole += ok
    print(f"token accuracy {right / max(total, 1):.3f} over {total} policy tokens")
    print("most missed (wanted, written):", misses.most_common(8))
    print(f"tools_copy_episode_acc: {whole / len(demos):.3f}")


if __name__ == "__main__":
    main()
