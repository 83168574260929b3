"""What the trajectory store costs a run, and how fast ``envhub view`` shows a big store.

    python benchmarks/trajectory_store.py                    # 30 RL steps each way, 100k episodes
    python benchmarks/trajectory_store.py --steps 20 --episodes 1000000

1. **Write overhead.** The quickstart (``examples/quickstart.yaml``: 128 Frozen Lake episodes per
   step) trains ``--steps`` RL steps with the store on (``logging.trajectories.every=1``, every
   episode kept) and off (``every=0``), in one process, alternating ABBA after a warm-up run, same
   seed. Reported: the store's cost on the training thread (``timing/store_s``: building the
   records) plus the writer thread's busy time (Arrow table, zstd Parquet, atomic rename), both
   per step, as a share of the step time with the store off; and the measured step times on vs
   off (noisier: the two cores are shared).
2. **First paint.** A store of ``--episodes`` synthetic episodes (quickstart-sized: ~6 turns, ~200
   tokens) in parts of 1,000, served by ``envhub view``'s app; real Chromium (Playwright) opens the
   page, switches to the episode table and waits until its first row is drawn. Reported: seconds
   from navigation to the first row (median of 3 page loads, each with a fresh viewer process
   state: a cold read of the store), and the API's time for the first page alone.

Last line ``view_first_paint_<N>: X s`` (N = episodes, in thousands when >= 1000).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# ------------------------------------------------------------------ 1. write overhead
def train(out: Path, steps: int, store: bool) -> dict[str, float]:
    """One quickstart run of ``steps`` RL steps; its per-step times and the store's costs."""
    from trainer.config import load_config
    from trainer.pipeline import AgenticPipeline

    overrides = [
        f"train.steps={steps}",
        "sft.epochs=2",  # the warm start is not what is measured
        "eval.every=0",
        "checkpoint.every=0",
        "logging.progress=false",
        f"logging.trajectories.every={1 if store else 0}",
        f"output_dir={out}",
    ]
    cfg = load_config(ROOT / "examples" / "quickstart.yaml", overrides)
    pipeline = AgenticPipeline(cfg)
    rows = pipeline.fit()
    rl = [r for r in rows if r["step"] >= 2]  # step 1 pays one-off start-up costs
    times = [b["time_s"] - a["time_s"] for a, b in itertools.pairwise(rl)]
    return {
        "step_s": statistics.median(times),
        "store_thread_s": statistics.mean(r.get("timing/store_s", 0.0) for r in rl),
        "writer_s": pipeline.store.busy_s / max(1, steps),
        "episodes_per_step": rows[-1].get("train/episodes", 0) or 0,
    }


def write_overhead(steps: int) -> float:
    """Print the on/off comparison; returns the store's cost as a share of the step time."""
    with tempfile.TemporaryDirectory(prefix="store-bench-") as tmp:
        runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        train(Path(tmp) / "warmup", 3, True)
        for i, store in enumerate((True, False, False, True)):
            runs[store].append(train(Path(tmp) / f"run{i}", steps, store))
            print(f"  run {i} store={'on ' if store else 'off'}: {runs[store][-1]}", flush=True)
    on = {k: statistics.mean(r[k] for r in runs[True]) for k in runs[True][0]}
    off = {k: statistics.mean(r[k] for r in runs[False]) for k in runs[False][0]}
    cost = on["store_thread_s"] + on["writer_s"]
    share = cost / off["step_s"]
    print(
        f"write overhead: step {off['step_s'] * 1000:.0f} ms (store off) vs "
        f"{on['step_s'] * 1000:.0f} ms (on, {on['step_s'] / off['step_s'] - 1:+.1%}); the store's "
        f"work per step {on['store_thread_s'] * 1000:.1f} ms on the training thread + "
        f"{on['writer_s'] * 1000:.1f} ms in the writer thread = {share:.2%} of a step",
        flush=True,
    )
    return share


# ------------------------------------------------------------------ 2. first paint
def synthetic_store(folder: Path, episodes: int, per_part: int = 1000) -> None:
    """``episodes`` quickstart-sized episodes, ``per_part`` per part (kind train, a step each)."""
    from envhub.runs import write_part

    turn = [
        {"role": "user", "content": "S F H\nP H H\nF F G\n\nYou moved down. Your next move?"},
        {"role": "assistant", "content": "down"},
    ]
    messages = json.dumps([{"role": "user", "content": "Let's play Frozen Lake. " * 12}, *turn * 6])
    ids = list(range(200))
    mask = [0] * 180 + [1] * 20
    for step in range(episodes // per_part):
        records = [
            {
                "env_id": "games/frozen-lake-v0",
                "seed": step * per_part + i,
                "group_id": i // 8,
                "success": (i * 7 + step) % 3 == 0,
                "failed": False,
                "return": float((i * 7 + step) % 3 == 0) - 0.01 * (i % 5),
                "turns": 1 + i % 6,
                "tokens": 200,
                "time_s": float(step),
                "messages": messages,
                "info": "{}",
                "token_ids": ids,
                "response_mask": mask,
                "logprobs": [-0.1] * 200,
                "advantages": [0.5] * 200,
                "row_starts": [0],
                "turn_rewards": [0.0] * 6,
            }
            for i in range(per_part)
        ]
        write_part(folder / "trajectories", "train", step + 1, records)
    rows = [{"step": s, "time_s": float(s), "train/success": 0.3} for s in range(1, step + 2)]
    (folder / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")


def first_paint(episodes: int, loads: int = 3) -> float:
    """Median seconds from navigation to the first drawn row of the episode table."""
    from playwright.sync_api import sync_playwright
    from starlette.testclient import TestClient

    from envhub.view import create_app
    from envs.web.browser_pool import CHROMIUM_FLAGS, chromium_path
    from tests.envhub.openai_servers import serve_app

    with tempfile.TemporaryDirectory(prefix="view-bench-") as tmp:
        started = time.perf_counter()
        synthetic_store(Path(tmp), episodes)
        size = sum(p.stat().st_size for p in (Path(tmp) / "trajectories").iterdir())
        print(
            f"store: {episodes} episodes, {size / 2**20:.0f} MiB in "
            f"{episodes // 1000} parts (written in {time.perf_counter() - started:.1f} s)",
            flush=True,
        )
        api = []
        for _ in range(loads):
            client = TestClient(create_app([tmp]), base_url="http://127.0.0.1")
            started = time.perf_counter()
            page = client.get("/api/episodes", params={"run": 0, "limit": 50}).json()
            api.append(time.perf_counter() - started)
        assert page["total"] == episodes, page.get("total")
        paints = []
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=chromium_path(), headless=True, args=CHROMIUM_FLAGS
            )
            for _ in range(loads):
                with serve_app(create_app([tmp])) as url:  # a fresh viewer: nothing cached
                    page_ = browser.new_page()
                    started = time.perf_counter()
                    page_.goto(url + "/")
                    page_.wait_for_selector("body[data-ready='1']")
                    page_.click("nav button[data-tab='episodes']")
                    page_.wait_for_selector("#episode-table tbody tr")
                    paints.append(time.perf_counter() - started)
                    page_.close()
            browser.close()
    print(
        f"first paint of the episode table over {episodes} episodes: "
        f"{', '.join(f'{p:.2f}' for p in paints)} s (API first page "
        f"{statistics.median(api) * 1000:.0f} ms median)",
        flush=True,
    )
    return statistics.median(paints)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="RL steps per training run")
    parser.add_argument("--episodes", type=int, default=100_000, help="episodes in the store")
    parser.add_argument("--skip-training", action="store_true", help="only the first paint")
    args = parser.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    if not args.skip_training:
        share = write_overhead(args.steps)
        print(f"store_write_overhead: {share * 100:.2f} %", flush=True)
    paint = first_paint(args.episodes)
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    n = f"{args.episodes // 1000}k" if args.episodes >= 1000 else str(args.episodes)
    print(f"view_first_paint_{n}: {paint:.2f} s")


if __name__ == "__main__":
    main()
