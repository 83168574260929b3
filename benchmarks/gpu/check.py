"""One-shot GPU check: FSDP2 and Megatron-Core train steps, CUDA-IPC weight transfer, HF generation.

Run through ``benchmarks/gpu/check.sh`` (it installs the carried megatron-core wheel first).
Every figure comes from the project's own code paths: ``trainer.strategies.fsdp2``,
``trainer.strategies.megatron`` (+ ``megatron_convert``), ``trainer.weights.buckets`` /
``transport`` and ``trainer.strategies.hf_engine``. Nothing is downloaded: the ~0.5B model is
a random-init Qwen2 with Qwen2.5-0.5B's shape, built from a config.

Sections (each isolated: one failing does not stop the others; results are rewritten to
``$OUT/gpu_check.json`` after every section so a timeout still leaves the finished ones):

``env``       torch / CUDA / GPU / megatron-core versions
``fsdp2``     train-step tokens/s and MFU (6*N*tokens/s / 989e12, the H100/H200 SXM bf16 dense
              peak), bf16 mixed precision, grad accumulation 2; again with activation
              checkpointing; full-state-dict gather time
``megatron``  Megatron-Core GPTModel (TP=1, SDPA core attention) train-step tokens/s and MFU;
              max |logprob| difference to the HF model on the same weights
``ipc``       weights bucketed (256 MiB) and handed to a second process by CUDA IPC, loaded
              into its HFEngine through ``VersionedEngine``: GB/s, vs a device memcpy of the
              same bytes
``generate``  HFEngine new tokens/s for a batch of prompts, greedy then sampled on the device
``lora``, ``packed``  through the trainer's config and roles (``check_trainer.py``): a LoRA step
              and a packed step of the 0.5B recipe, tokens/s and MFU; skipped, saying why, while
              ``model.lora`` / ``train.packing`` are not wired into the trainer

``--smoke`` runs the same sections on the CPU with a tiny model (gloo, shared memory
instead of CUDA IPC, 1-2 steps) to prove the script end to end without a GPU.
Last line: ``gpu_check: done``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

PEAK_BF16 = 989e12
"""H100/H200 SXM dense bf16 tensor-core peak, FLOP/s."""

QWEN2_05B = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
}
TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class Settings:
    def __init__(self, smoke: bool) -> None:
        import torch

        self.smoke = smoke
        self.device = "cpu" if smoke else "cuda"
        if not smoke and not torch.cuda.is_available():
            raise SystemExit("no CUDA device visible; run with --smoke for the CPU check")
        self.config = TINY if smoke else QWEN2_05B
        self.rows, self.width = (2, 16) if smoke else (8, 1024)
        self.micro = 1 if smoke else 4
        self.warmup, self.steps = (1, 1) if smoke else (1, 3)
        # > the 0.5B model's 260 MiB embedding
        self.bucket_bytes = (64 << 10) if smoke else (512 << 20)
        self.gen_prompts, self.gen_prompt_len, self.gen_new = (4, 8, 8) if smoke else (64, 128, 128)


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build_model(s: Settings, seed: int = 0) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(**s.config)
    with torch.device(s.device):
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def batch(s: Settings) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, s.config["vocab_size"], (s.rows, s.width), generator=g)
    mask = torch.ones_like(ids)
    response = mask.clone()
    response[:, : s.width // 4] = 0
    return {"input_ids": ids, "attention_mask": mask, "response_mask": response}


def nll(out: Any, mb: Any) -> tuple[Any, dict[str, float]]:
    mask = mb["response_mask"].float()
    loss = -(out.logprobs * mask).sum() / mask.sum()
    return loss, {"nll": float(loss.detach())}


def n_params(model: Any) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def time_steps(s: Settings, strategy: Any) -> dict[str, Any]:
    data = batch(s)
    for _ in range(s.warmup):
        strategy.train_step(data, nll)
    sync(s.device)
    start = time.perf_counter()
    metrics = [strategy.train_step(data, nll) for _ in range(s.steps)]
    sync(s.device)
    step_s = (time.perf_counter() - start) / s.steps
    return {
        "step_s": step_s,
        "tokens_per_s": s.rows * s.width / step_s,
        "nll_first_last": [metrics[0]["nll"], metrics[-1]["nll"]],
        "optimizer_steps_per_call": metrics[-1]["optimizer_steps"],
    }


def mfu(params: int, tokens_per_s: float) -> float:
    return 6 * params * tokens_per_s / PEAK_BF16


def peak_mem_gib(s: Settings) -> float | None:
    import torch

    if not s.device.startswith("cuda"):
        return None
    value = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return round(value, 2)


def free(s: Settings) -> None:
    import gc

    import torch

    gc.collect()
    if s.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# --------------------------------------------------------------------------- sections


def section_env(s: Settings) -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "device": s.device,
        "smoke": s.smoke,
    }
    if s.device.startswith("cuda"):
        info.update(
            gpu=torch.cuda.get_device_name(0),
            cuda=torch.version.cuda,
            gpu_mem_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
        )
    try:
        from importlib.metadata import version

        info["megatron_core"] = version("megatron-core")
    except Exception as error:  # noqa: BLE001 - reported, not fatal
        info["megatron_core"] = f"missing ({error})"
    return info


def section_fsdp2(s: Settings) -> dict[str, Any]:
    from trainer.strategies.fsdp2 import FSDP2TrainStrategy

    result: dict[str, Any] = {}
    for tag, checkpointing in (("plain", False), ("activation_checkpointing", True)):
        model = build_model(s)
        params = n_params(model)
        strategy = FSDP2TrainStrategy(
            model,
            lr=1e-5,
            micro_batch_size=s.micro,
            grad_accumulation=s.rows // s.micro,
            device=s.device,
            activation_checkpointing=checkpointing,
        )
        figures = time_steps(s, strategy)
        figures.update(
            params=params,
            mfu=mfu(params, figures["tokens_per_s"]),
            peak_mem_gib=peak_mem_gib(s),
            mixed_precision=strategy.mixed_precision,
            world_size=strategy.world_size,
        )
        if tag == "plain":
            start = time.perf_counter()
            full = strategy.full_state_dict()
            figures["full_state_dict_s"] = time.perf_counter() - start
            figures["full_state_dict_tensors"] = len(full)
            del full
        result[tag] = figures
        log(f"fsdp2 {tag}: {figures['tokens_per_s']:.0f} tok/s, MFU {figures['mfu']:.3f}")
        del strategy, model
        free(s)
    return result


def section_megatron(s: Settings) -> dict[str, Any]:
    import torch

    from trainer.strategies.hf import HFTrainStrategy
    from trainer.strategies.megatron import MegatronTrainStrategy

    model = build_model(s)
    params = n_params(model)
    data = batch(s)
    probe = {k: v[:1, :128] for k, v in data.items()}
    reference = (
        HFTrainStrategy(model, micro_batch_size=1, trainable=False, device=s.device)
        .forward(probe)
        .logprobs
    )
    model.requires_grad_(True)
    strategy = MegatronTrainStrategy(
        model,
        lr=1e-5,
        micro_batch_size=s.micro,
        grad_accumulation=s.rows // s.micro,
        device=s.device,
        tensor_parallel_size=1,
        mixed_precision=False,
    )
    fp32_diff = float((strategy.forward(probe).logprobs - reference).abs().max())
    strategy.mixed_precision = s.device.startswith("cuda")
    del model
    free(s)
    figures = time_steps(s, strategy)
    figures.update(
        params=params,
        mfu=mfu(params, figures["tokens_per_s"]),
        peak_mem_gib=peak_mem_gib(s),
        max_logprob_diff_vs_hf_fp32=fp32_diff,
        tensor_parallel_size=1,
        cpu_shim_active=__import__(
            "trainer.strategies.megatron_cpu_shim", fromlist=["x"]
        ).is_active(),
    )
    log(
        f"megatron: {figures['tokens_per_s']:.0f} tok/s, MFU {figures['mfu']:.3f}, "
        f"|dlogp| {fp32_diff:.2e}"
    )
    del strategy
    free(s)
    torch.cuda.empty_cache() if s.device.startswith("cuda") else None
    return figures


def _receiver(inbox: Any, outbox: Any, smoke: bool) -> None:
    """Second process: an HFEngine behind VersionedEngine, loading buckets opened from IPC
    handles."""
    sys.path.insert(0, str(ROOT))
    warnings.filterwarnings("ignore")
    try:
        import torch

        from trainer.strategies.hf_engine import HFEngine
        from trainer.weights.transport import open_bucket
        from trainer.weights.versioned import VersionedEngine

        s = Settings(smoke)
        model = build_model(s, seed=1).to(torch.bfloat16 if not smoke else torch.float32)
        engine = VersionedEngine(HFEngine(model, eos_token_id=-1, pad_token_id=0, device=s.device))
        outbox.put(("ready", None))
        while True:
            message = inbox.get(timeout=120)
            if message is None:
                break
            version, names = message

            def buckets() -> Any:
                while True:
                    handle = inbox.get(timeout=120)
                    if handle is None:
                        return
                    bucket, close = open_bucket(handle)
                    yield bucket
                    sync(s.device)
                    close()
                    outbox.put(("ack", handle.index))

            engine.load(buckets(), version=version, expected_names=names)
            sync(s.device)
            checksum = float(sum(p.float().sum() for p in engine.engine.model.parameters()))
            outbox.put(("done", {"version": engine.weights_version, "checksum": checksum}))
    except Exception:  # noqa: BLE001 - sent to the parent, which reports it
        outbox.put(("error", traceback.format_exc()))


def section_ipc(s: Settings) -> dict[str, Any]:
    import torch
    import torch.multiprocessing as mp

    from trainer.weights.buckets import iter_buckets
    from trainer.weights.transport import share_bucket

    dtype = torch.float32 if s.smoke else torch.bfloat16
    model = build_model(s, seed=2).to(dtype)
    seen: set[int] = set()
    weights = []
    for name, tensor in model.state_dict().items():  # tied lm_head/embedding sent once
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            weights.append((name, tensor))
    total = sum(t.numel() * t.element_size() for _, t in weights)
    expected_checksum = float(sum(p.float().sum() for p in model.parameters()))
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(inbox, outbox, s.smoke), daemon=True)
    proc.start()

    def expect(kind: str) -> Any:
        got, payload = outbox.get(timeout=180)
        if got == "error":
            raise RuntimeError(f"receiver failed:\n{payload}")
        if got != kind:
            raise RuntimeError(f"receiver sent {got!r}, expected {kind!r}")
        return payload

    try:
        expect("ready")
        trials = []
        for version in (1, 2, 3):
            sync(s.device)
            start = time.perf_counter()
            inbox.put((version, [n for n, _ in weights]))
            for bucket in iter_buckets(weights, s.bucket_bytes, device=s.device):
                sync(s.device)
                handle, release = share_bucket(bucket)
                inbox.put(handle)
                expect("ack")
                release()
            inbox.put(None)
            done = expect("done")
            trials.append(time.perf_counter() - start)
            if done["version"] != version:
                raise RuntimeError(f"receiver serves version {done['version']}, sent {version}")
        checksum_ok = abs(done["checksum"] - expected_checksum) <= 1e-3 * max(
            1.0, abs(expected_checksum)
        )
        inbox.put(None)
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.kill()
    best = min(trials)
    src = torch.empty(total, dtype=torch.uint8, device=s.device)
    dst = torch.empty_like(src)
    copies = []
    for _ in range(5):
        sync(s.device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(s.device)
        copies.append(time.perf_counter() - start)
    memcpy_gbs = total / min(copies) / 1e9
    figures = {
        "bytes": total,
        "tensors": len(weights),
        "bucket_bytes": s.bucket_bytes,
        "transport": "cuda_ipc" if s.device.startswith("cuda") else "shared_memory",
        "sync_s_trials": trials,
        "sync_gb_s": total / best / 1e9,
        "memcpy_gb_s": memcpy_gbs,
        "sync_vs_memcpy": (total / best / 1e9) / memcpy_gbs,
        "checksum_ok": checksum_ok,
    }
    log(
        f"ipc: {figures['sync_gb_s']:.1f} GB/s sync vs {memcpy_gbs:.1f} GB/s memcpy, "
        f"checksum ok={checksum_ok}"
    )
    del model, src, dst
    free(s)
    return figures


def section_generate(s: Settings) -> dict[str, Any]:
    import torch

    from trainer.strategies.base import GenerationRequest
    from trainer.strategies.hf_engine import HFEngine

    model = build_model(s, seed=3).to(torch.float32 if s.smoke else torch.bfloat16)
    # eos -1: every row runs to the limit
    engine = HFEngine(model, eos_token_id=-1, pad_token_id=0, device=s.device)
    g = torch.Generator().manual_seed(0)

    def requests(count: int, new: int, temperature: float) -> list[GenerationRequest]:
        return [
            GenerationRequest(
                f"r{i}",
                torch.randint(1, s.config["vocab_size"], (s.gen_prompt_len,), generator=g).tolist(),
                max_new_tokens=new,
                temperature=temperature,
            )
            for i in range(count)
        ]

    engine.generate_batch(requests(2, 4, 1.0))
    figures: dict[str, Any] = {
        "prompts": s.gen_prompts,
        "prompt_len": s.gen_prompt_len,
        "max_new_tokens": s.gen_new,
    }
    for kind, temperature in (("greedy", 0.0), ("sampled", 1.0)):  # sampling on the device
        sync(s.device)
        start = time.perf_counter()
        results = engine.generate_batch(requests(s.gen_prompts, s.gen_new, temperature))
        sync(s.device)
        elapsed = time.perf_counter() - start
        new_tokens = sum(len(r.token_ids) for r in results)
        figures[kind] = {"new_tokens": new_tokens, "seconds": elapsed}
        figures[f"{kind}_tokens_per_s"] = new_tokens / elapsed
        log(f"generate {kind}: {new_tokens / elapsed:.0f} new tok/s ({s.gen_prompts} prompts)")
    figures["tokens_per_s"] = figures["greedy_tokens_per_s"]
    del engine, model
    free(s)
    return figures


# the trainer-path sections live beside this script (its folder is on sys.path when it runs)
from check_trainer import SECTIONS as TRAINER_SECTIONS

SECTIONS = {
    "env": section_env,
    "fsdp2": section_fsdp2,
    "megatron": section_megatron,
    "ipc": section_ipc,
    "generate": section_generate,
    **TRAINER_SECTIONS,
}


def summary(results: dict[str, Any]) -> list[str]:
    def get(*path: str) -> Any:
        node: Any = results
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    rows = [
        ("fsdp2 train tokens/s", fmt(get("fsdp2", "plain", "tokens_per_s"), ",.0f")),
        ("fsdp2 MFU", fmt(get("fsdp2", "plain", "mfu"), ".3f")),
        (
            "fsdp2+AC train tokens/s",
            fmt(get("fsdp2", "activation_checkpointing", "tokens_per_s"), ",.0f"),
        ),
        ("fsdp2 full-state-dict gather s", fmt(get("fsdp2", "plain", "full_state_dict_s"), ".3f")),
        ("megatron train tokens/s", fmt(get("megatron", "tokens_per_s"), ",.0f")),
        ("megatron MFU", fmt(get("megatron", "mfu"), ".3f")),
        ("megatron |dlogp| vs HF", fmt(get("megatron", "max_logprob_diff_vs_hf_fp32"), ".2e")),
        ("weight sync GB/s", fmt(get("ipc", "sync_gb_s"), ".2f")),
        ("device memcpy GB/s", fmt(get("ipc", "memcpy_gb_s"), ".2f")),
        ("sync / memcpy", fmt(get("ipc", "sync_vs_memcpy"), ".3f")),
        ("HF engine generate tokens/s", fmt(get("generate", "tokens_per_s"), ",.0f")),
        ("LoRA r16 train tokens/s", fmt(get("lora", "tokens_per_s"), ",.0f")),
        ("LoRA MFU (4N per token)", fmt(get("lora", "mfu_4n"), ".3f")),
        ("LoRA peak GiB", fmt(get("lora", "peak_mem_gib"), ".2f")),
        ("LoRA estimate / peak", fmt(get("lora", "estimate_over_peak"), ".2f")),
        ("packed train tokens/s", fmt(get("packed", "packed", "tokens_per_s"), ",.0f")),
        ("packed MFU (6N per token)", fmt(get("packed", "packed", "mfu_6n"), ".3f")),
        ("padded train tokens/s", fmt(get("packed", "padded", "tokens_per_s"), ",.0f")),
        ("packed / padded", fmt(get("packed", "packed_over_padded"), ".2f")),
    ]
    lines = [f"{'figure':34s} value"] + [f"{name:34s} {value}" for name, value in rows]
    lines += [
        f"{'SKIPPED ' + name:34s} {results[name]['skipped'][:80]}"
        for name in SECTIONS
        if isinstance(results.get(name), dict) and "skipped" in results[name]
    ]
    lines += [
        f"{'FAILED ' + name:34s} {results[name]['error'].splitlines()[-1][:80]}"
        for name in SECTIONS
        if isinstance(results.get(name), dict) and "error" in results[name]
    ]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny model on CPU (gloo, shared memory)"
    )
    parser.add_argument("--only", nargs="*", choices=list(SECTIONS), help="run only these sections")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT") or ROOT / "gpu-out")
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    s = Settings(args.smoke)
    if s.smoke:
        import torch

        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    for name, fn in SECTIONS.items():
        if args.only and name not in args.only and name != "env":
            continue
        log(f"section {name} ...")
        start = time.perf_counter()
        try:
            results[name] = fn(s)
        except Exception:  # noqa: BLE001 - one failing section must not stop the others
            results[name] = {"error": traceback.format_exc()}
            log(f"section {name} FAILED:\n{results[name]['error']}")
        results.setdefault(name, {})["section_s"] = round(time.perf_counter() - start, 2)
        (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    from trainer.strategies.distributed import shutdown_process_group

    try:
        shutdown_process_group()
    except RuntimeError as exc:  # a rank that failed a section may miss the barrier
        log(f"shutting down the process group failed: {exc}")
    table = summary(results)
    (out / "summary.txt").write_text("\n".join(table) + "\n")
    print("\n".join(table), flush=True)
    failed = [n for n in SECTIONS if isinstance(results.get(n), dict) and "error" in results[n]]
    print(f"failed sections: {failed or 'none'}", flush=True)
    print("gpu_check: done", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
