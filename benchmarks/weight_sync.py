"""Train -> inference weight sync: seconds and GB/s, FSDP2 (2 ranks) and Megatron TP=2 into vLLM.

For random Llama models of ~10M, ~100M and ~500M parameters (fp32), each trainer rank a Ray
worker process (gloo) and the engine (vLLM, TP=1; ``--engine hf`` for the torch engine) in
another, it times the real sync paths (``trainer.weights.sync.WeightSync``): ``shm`` - each
trainer rank writes its own shards straight into shared-memory buckets laid out as full HF
tensors, the engine loads zero-copy views of them, version check; ``bcast`` - gather per
bucket into full HF tensors, gloo broadcast to the engine, version check - side by side with

* ``memcpy``: one ``copy_`` of the same number of bytes between two host buffers (the bound a
  colocated sync cannot beat: every byte is copied at least once), and
* ``disk``: the naive path - rank 0 writes a ``save_pretrained`` folder, the engine reads the
  safetensors back and loads them.

Each figure is the best of ``--repeats`` runs after one warm-up (the 2 vCPUs are shared, so
the best run is the least disturbed one). The last line is ``sync_vs_memcpy: X`` - FSDP2
shared-memory sync bandwidth / memcpy bandwidth for the largest model that ran.

``--lora`` instead trains rank-``--rank`` adapters on every linear layer (``model.lora``) and
times, on the same trainer ranks and engine, a full sync of the weights (what a sync without
adapter support moves) against an adapter-only sync (``WeightSync(adapters=True)`` after its
first, full, sync): last line ``lora_sync_speedup: X x`` for the largest model.

    python benchmarks/weight_sync.py                  # 10M, 100M, 500M
    python benchmarks/weight_sync.py --sizes 10M      # quick
    python benchmarks/weight_sync.py --lora --sizes 100M 500M --strategies fsdp2
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPES = {  # name -> (hidden, layers, intermediate); head size 64 (vLLM CPU attention supports it)
    "10M": (256, 10, 1024),
    "100M": (768, 14, 2048),
    "500M": (1280, 24, 3456),
}
STRATEGIES = {"fsdp2": {}, "megatron": {"tensor_parallel_size": 2}}


def build_model(name: str, root: Path) -> tuple[Path, int]:
    """A random Llama of the given shape saved as an HF folder; returns (folder, parameter
    count)."""
    from trainer.models import build_policy, env_corpus

    hidden, layers, inter = SHAPES[name]
    folder = build_policy(
        root / name,
        env_corpus("games/frozen-lake-v0", {"size": 3}, episodes=40),
        tokenizer_kind="bpe",
        hidden_size=hidden,
        num_layers=layers,
        num_heads=hidden // 64,
        intermediate_size=inter,
        max_positions=256,
        seed=0,
    )
    from transformers import AutoConfig, AutoModelForCausalLM

    with __import__("torch").device("meta"):
        params = sum(
            p.numel()
            for p in AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(folder)
            ).parameters()
        )
    return folder, params


def best(fn: Any, repeats: int) -> float:
    """Best wall time of ``repeats`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return best(lambda: dst.copy_(src), repeats)


def measure(
    strategy: str, folder: Path, infer: Any, policy: Any, repeats: int, scratch: Path
) -> dict[str, Any]:
    """Time each path from a fresh ``strategy`` trainer into ``infer``, whose weights version
    ``policy`` tracks (one per engine cluster: engines refuse a version they already served)."""
    from trainer.config import RoleConfig
    from trainer.weights.sync import WeightSync
    from trainer.workers.actor import ActorCluster

    role = RoleConfig(
        strategy=strategy, device_mapping=[], num_workers=2, strategy_args=STRATEGIES[strategy]
    )
    started = time.perf_counter()
    actor = ActorCluster(
        "actor_train", role, backend="ray", worker_kwargs={"model_path": str(folder)}
    )
    out: dict[str, Any] = {"start_s": time.perf_counter() - started}
    try:
        shm = WeightSync(actor, infer, policy=policy, transport="shared_memory", bucket_mb=256)
        reports = []
        out["shm_s"] = best(lambda: reports.append(shm.sync()), repeats)
        out["nbytes"] = reports[-1].nbytes
        out["buckets"] = reports[-1].buckets
        out["phases"] = min(reports[1:] or reports, key=lambda r: r.seconds).phases
        # one version
        bcast = WeightSync(actor, infer, policy=shm.policy, transport="broadcast", bucket_mb=256)
        out["broadcast_s"] = best(bcast.sync, repeats)
        target = scratch / f"disk_{strategy}"

        def disk() -> None:
            shutil.rmtree(target, ignore_errors=True)
            actor.save_pretrained(str(target))
            infer.load_weights_file(str(target))

        out["disk_s"] = best(disk, repeats)
        shutil.rmtree(target, ignore_errors=True)
        policy.restore(max(infer.weights_version()))  # each disk load served a new version
    finally:
        actor.shutdown()
    return out


def measure_lora(
    strategy: str, folder: Path, infer: Any, policy: Any, repeats: int, rank: int
) -> dict[str, Any]:
    """Full sync vs adapter-only sync of a LoRA policy (same trainer ranks, same engine, whose
    weights version ``policy`` tracks)."""
    from trainer.config import LoraConfig, RoleConfig
    from trainer.weights.sync import WeightSync
    from trainer.workers.actor import ActorCluster

    role = RoleConfig(
        strategy=strategy, device_mapping=[], num_workers=2, strategy_args=STRATEGIES[strategy]
    )
    actor = ActorCluster(
        "actor_train",
        role,
        backend="ray",
        worker_kwargs={"model_path": str(folder), "lora": LoraConfig(rank=rank)},
    )
    out: dict[str, Any] = {}
    try:
        full = WeightSync(actor, infer, policy=policy, transport="shared_memory", bucket_mb=256)
        reports: list[Any] = []
        out["full_s"] = best(lambda: reports.append(full.sync()), repeats)
        out["full_bytes"] = reports[-1].nbytes
        adapters = WeightSync(actor, infer, policy=full.policy, adapters=True, bucket_mb=256)
        adapters.sync()  # the first sync carries the base too
        reports.clear()
        out["adapter_s"] = best(lambda: reports.append(adapters.sync()), repeats)
        out["adapter_bytes"] = reports[-1].nbytes
        out["adapter_transport"] = reports[-1].transport
        out["adapter_phases"] = min(reports, key=lambda r: r.seconds).phases
    finally:
        actor.shutdown()
    return out


def main_lora(args: argparse.Namespace, scratch: Path) -> None:
    """``--lora``: the adapter-only sync against a full sync, per model size."""
    from trainer.config import RoleConfig
    from trainer.weights.versioned import PolicyVersion
    from trainer.workers.infer import InferCluster

    print(
        f"{'model':>6} {'params':>8} {'strategy':>9} | {'full MB':>8} {'full s':>7} | "
        f"{'adapter MB':>10} {'adapter s':>9} | speedup",
        flush=True,
    )
    headline: float | None = None
    for size in args.sizes:
        folder, params = build_model(size, scratch)
        infer = InferCluster(
            "actor_infer",
            RoleConfig(strategy=args.engine, device_mapping=[]),
            backend="ray",
            worker_kwargs={"model_path": str(folder), "adapter_rank": args.rank},
        )
        policy = PolicyVersion()
        try:
            for strategy in args.strategies:
                row = measure_lora(strategy, folder, infer, policy, args.repeats, args.rank)
                headline = row["full_s"] / row["adapter_s"]
                print(
                    f"{size:>6} {params / 1e6:>7.1f}M {strategy:>9} | "
                    f"{row['full_bytes'] / 2**20:>8.1f} {row['full_s']:>7.3f} | "
                    f"{row['adapter_bytes'] / 2**20:>10.2f} {row['adapter_s']:>9.4f} | "
                    f"{headline:.1f} x ({row['adapter_transport']}, rank {args.rank}; adapter "
                    + ", ".join(f"{k} {v:.4f} s" for k, v in row["adapter_phases"].items())
                    + ")",
                    flush=True,
                )
        finally:
            infer.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
    print(f"lora_sync_speedup: {headline:.1f} x" if headline else "lora_sync_speedup: nan x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument(
        "--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES)
    )
    parser.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--lora", action="store_true", help="adapter-only vs full sync")
    parser.add_argument("--rank", type=int, default=16, help="adapter rank with --lora")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import ray

    from trainer.config import RoleConfig
    from trainer.controller.resources import init_local_ray
    from trainer.weights.versioned import PolicyVersion
    from trainer.workers.infer import InferCluster

    init_local_ray(0, num_cpus=2, env_vars={"OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]})
    scratch = Path(tempfile.mkdtemp(prefix="weight_sync_"))
    if args.lora:
        try:
            main_lora(args, scratch)
        finally:
            ray.shutdown()
            shutil.rmtree(scratch, ignore_errors=True)
        return
    headline: float | None = None
    print(
        f"{'model':>6} {'params':>8} {'strategy':>9} {'MB':>7} | {'shm s':>7} {'GB/s':>6} | "
        f"{'bcast s':>7} {'GB/s':>6} | {'disk s':>7} {'GB/s':>6} | {'memcpy GB/s':>11} | "
        "sync/memcpy",
        flush=True,
    )
    try:
        for size in args.sizes:
            folder, params = build_model(size, scratch)
            infer = InferCluster(
                "actor_infer",
                RoleConfig(strategy=args.engine, device_mapping=[]),
                backend="ray",
                worker_kwargs={"model_path": str(folder)},
            )
            policy = PolicyVersion()
            try:
                for strategy in args.strategies:
                    row = measure(strategy, folder, infer, policy, args.repeats, scratch)
                    nbytes = row["nbytes"]
                    memcpy = nbytes / 1e9 / memcpy_seconds(nbytes, args.repeats + 1)
                    gbps = {k: nbytes / 1e9 / row[f"{k}_s"] for k in ("shm", "broadcast", "disk")}
                    ratio = gbps["shm"] / memcpy
                    if strategy == "fsdp2" or headline is None:
                        headline = ratio
                    print(
                        f"{size:>6} {params / 1e6:>7.1f}M {strategy:>9} {nbytes / 2**20:>7.0f} | "
                        f"{row['shm_s']:>7.3f} {gbps['shm']:>6.2f} | {row['broadcast_s']:>7.3f} "
                        f"{gbps['broadcast']:>6.2f} | {row['disk_s']:>7.3f} {gbps['disk']:>6.2f} "
                        f"| {memcpy:>11.2f} | {ratio:.3f}   ({row['buckets']} buckets, trainer "
                        f"start {row['start_s']:.1f} s)",
                        flush=True,
                    )
                    print(
                        "         shm phases (s): "
                        + ", ".join(f"{k} {v:.3f}" for k, v in row["phases"].items()),
                        flush=True,
                    )
            finally:
                infer.shutdown()
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        ray.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"sync_vs_memcpy: {headline:.3f}" if headline is not None else "sync_vs_memcpy: nan")


if __name__ == "__main__":
    main()
