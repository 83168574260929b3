"""Code that runs inside started ranks (importable by name, so ``ranks.run_ranks`` can pickle it).

Each function is one rank's body: it joins a gloo group on a given port, does its part and
writes what the test asserts on into ``out`` (a ``mp.Manager().dict()``) under ``(rank, key)``.
"""

from __future__ import annotations

import os
from typing import Any


def tiny_qwen2(
    seed: int = 0,
    *,
    layers: int = 2,
    vocab: int = 61,
    tie: bool = False,
    bias: bool = True,
    rope_theta: float = 10000.0,
) -> Any:
    """A small random Qwen2 (GQA: 4 query heads, 2 KV heads) built from a config."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
        rope_theta=rope_theta,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if not bias:
        for module in model.modules():
            for name in ("q_proj", "k_proj", "v_proj"):
                proj = getattr(module, name, None)
                if proj is not None and proj.bias is not None:
                    torch.nn.init.zeros_(proj.bias)
    return model


def tiny_batch(rows: int = 4, width: int = 12, vocab: int = 61, seed: int = 1) -> dict[str, Any]:
    """Equal-length rows (no padding), so per-rank token-mean losses average to the global one."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, width), generator=g)
    mask = torch.ones(rows, width, dtype=torch.long)
    response = mask.clone()
    response[:, 0] = 0
    return {"input_ids": ids, "attention_mask": mask, "response_mask": response}


def nll_loss(out: Any, mb: Any) -> tuple[Any, dict[str, float]]:
    mask = mb["response_mask"].float()
    loss = -(out.logprobs * mask).sum() / mask.sum()
    return loss, {"nll": float(loss.detach())}


def join(rank: int, world: int, port: int) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
        }
    )
    import torch

    torch.set_num_threads(1)


def fsdp2_rank(rank: int, world: int, port: int, out: Any) -> None:
    """Two FSDP2 runs, tiny Qwen2: even split (2 steps), then ragged (rank 0: 3 rows, rank 1: 1)."""
    join(rank, world, port)
    from trainer.strategies.distributed import shutdown_process_group
    from trainer.strategies.fsdp2 import FSDP2TrainStrategy

    for tag, rows_per_rank, steps in (("even", [2, 2], 2), ("ragged", [3, 1], 1)):
        batch = tiny_batch(rows=sum(rows_per_rank))
        start = sum(rows_per_rank[:rank])
        mine = {k: v[start : start + rows_per_rank[rank]] for k, v in batch.items()}
        strategy = FSDP2TrainStrategy(tiny_qwen2(), lr=1e-2, micro_batch_size=1, device="cpu")
        out[(tag, rank, "logprobs")] = strategy.forward(mine).logprobs
        out[(tag, rank, "metrics")] = [strategy.train_step(mine, nll_loss) for _ in range(steps)]
        out[(tag, rank, "weights")] = {k: v.clone() for k, v in strategy.full_weights(device="cpu")}
        out[(tag, rank, "state_keys")] = sorted(strategy.full_state_dict())
    shutdown_process_group()


def fsdp2_empty_rank(rank: int, world: int, port: int, out: Any) -> None:
    """FSDP2 where rank 1 gets no rows at all (a chunk smaller than the world size)."""
    join(rank, world, port)
    from trainer.strategies.distributed import shutdown_process_group
    from trainer.strategies.fsdp2 import FSDP2TrainStrategy

    batch = tiny_batch(rows=1)
    mine = {k: v[:1] if rank == 0 else v[:0] for k, v in batch.items()}
    strategy = FSDP2TrainStrategy(tiny_qwen2(), lr=1e-2, micro_batch_size=1, device="cpu")
    out[(rank, "logprobs")] = strategy.forward(mine).logprobs
    out[(rank, "metrics")] = strategy.train_step(mine, nll_loss)
    out[(rank, "weights")] = {k: v.clone() for k, v in strategy.full_weights(device="cpu")}
    shutdown_process_group()


def megatron_rank(rank: int, world: int, port: int, out: Any) -> None:
    """Megatron on 2 gloo ranks: TP=2 (both ranks see half the rows each), then TP=1 x DP=2."""
    join(rank, world, port)
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as mpu

    from trainer.strategies.distributed import shutdown_process_group
    from trainer.strategies.megatron import MegatronTrainStrategy

    batch = tiny_batch(rows=4)
    mine = {k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}
    for tag, tp in (("tp2", 2), ("dp2", 1)):
        strategy = MegatronTrainStrategy(
            tiny_qwen2(tie=tp == 1),
            lr=1e-2,
            micro_batch_size=2,
            device="cpu",
            tensor_parallel_size=tp,
        )
        out[(tag, rank, "shard_rows")] = int(
            strategy.model.state_dict()["decoder.layers.0.mlp.linear_fc1.weight"].shape[0]
        )
        out[(tag, rank, "logprobs")] = strategy.forward(mine).logprobs
        out[(tag, rank, "metrics")] = strategy.train_step(mine, nll_loss)
        out[(tag, rank, "weights")] = {k: v.clone() for k, v in strategy.full_weights(device="cpu")}
        mpu.destroy_model_parallel()
    shutdown_process_group()


def megatron_forward_rank(rank: int, world: int, port: int, out: Any, **model: Any) -> None:
    """One megatron rank (world 1): the log-probs of ``tiny_qwen2(**model)`` on ``tiny_batch``,
    and whether ``attention="local"`` is refused on this CPU."""
    join(rank, world, port)
    import warnings

    warnings.filterwarnings("ignore")
    from trainer.strategies.distributed import shutdown_process_group
    from trainer.strategies.megatron import MegatronTrainStrategy
    from trainer.strategies.parallel_errors import ParallelConfigError

    strategy = MegatronTrainStrategy(tiny_qwen2(**model), lr=1e-2, micro_batch_size=4, device="cpu")
    out[(rank, "logprobs")] = strategy.forward(tiny_batch(rows=4)).logprobs
    try:
        MegatronTrainStrategy(tiny_qwen2(), lr=1e-2, device="cpu", attention="local")
        out[(rank, "local")] = "built"
    except ParallelConfigError as error:
        out[(rank, "local")] = str(error)
    shutdown_process_group()


def resume_rank(rank: int, world: int, port: int, out: Any, name: str) -> None:
    """Train 1 step, checkpoint (state_dict), 1 more -> A; fresh strategy, load, same step -> B."""
    join(rank, world, port)
    import warnings

    warnings.filterwarnings("ignore")
    from trainer.strategies.distributed import shutdown_process_group

    batch = tiny_batch(rows=4)
    mine = {k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}
    second = tiny_batch(rows=4, seed=5)
    mine2 = {k: v[2 * rank : 2 * rank + 2] for k, v in second.items()}

    def build() -> Any:
        if name == "fsdp2":
            from trainer.strategies.fsdp2 import FSDP2TrainStrategy

            return FSDP2TrainStrategy(tiny_qwen2(), lr=1e-2, micro_batch_size=2, device="cpu")
        from trainer.strategies.megatron import MegatronTrainStrategy

        return MegatronTrainStrategy(
            tiny_qwen2(), lr=1e-2, micro_batch_size=2, device="cpu", tensor_parallel_size=2
        )

    strategy = build()
    strategy.train_step(mine, nll_loss)
    state = strategy.state_dict()
    everyone: list[Any] = [None] * world
    import torch.distributed as dist

    dist.all_gather_object(everyone, state)  # the cluster hands rank 0's checkpoint to every rank
    checkpoint = everyone[0]
    strategy.train_step(mine2, nll_loss)
    out[(rank, "straight")] = {k: v.clone() for k, v in strategy.full_weights(device="cpu")}
    resumed = build()
    resumed.load_state_dict(checkpoint)
    resumed.train_step(mine2, nll_loss)
    out[(rank, "resumed")] = {k: v.clone() for k, v in resumed.full_weights(device="cpu")}
    shutdown_process_group()


def megatron_pp_rank(
    rank: int, world: int, port: int, out: Any, tp: int, pp: int, tie: bool
) -> None:
    """Megatron TP x PP on ``world`` gloo ranks (one pipeline when world == tp * pp): forward, one
    train step, gathered weights, and a save/load round trip of the sharded checkpoint."""
    join(rank, world, port)
    import warnings

    warnings.filterwarnings("ignore")
    from trainer.strategies.distributed import shutdown_process_group
    from trainer.strategies.megatron import MegatronTrainStrategy

    batch = tiny_batch(rows=4)
    per = 4 // world
    mine = {k: v[per * rank : per * rank + per] for k, v in batch.items()}

    def build() -> Any:
        return MegatronTrainStrategy(
            tiny_qwen2(tie=tie, layers=4),
            lr=1e-2,
            micro_batch_size=1,
            device="cpu",
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
        )

    strategy = build()
    out[(rank, "stage_layers")] = sum(
        1 for n in strategy.model.state_dict() if n.endswith("input_layernorm.weight")
    )
    out[(rank, "initial")] = {k: v.clone() for k, v in strategy.full_weights(device="cpu")}
    out[(rank, "logprobs")] = strategy.forward(mine).logprobs
    out[(rank, "metrics")] = strategy.train_step(mine, nll_loss)
    out[(rank, "weights")] = {k: v.clone() for k, v in strategy.full_weights(device="cpu")}
    state = strategy.state_dict()
    import torch.distributed as dist

    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, state)  # the cluster hands rank 0's checkpoint to every rank
    second = tiny_batch(rows=4, seed=5)
    mine2 = {k: v[per * rank : per * rank + per] for k, v in second.items()}
    strategy.train_step(mine2, nll_loss)
    out[(rank, "straight")] = {k: v.clone() for k, v in strategy.full_weights(device="cpu")}
    strategy.load_state_dict(everyone[0])
    strategy.train_step(mine2, nll_loss)
    out[(rank, "resumed")] = {k: v.clone() for k, v in strategy.full_weights(device="cpu")}
    shutdown_process_group()


def fsdp2_tp_rank(rank: int, world: int, port: int, out: Any, tp: int) -> None:
    """FSDP2 + DTensor tensor parallelism (mesh dp x tp), tiny Qwen2: forward, 2 steps, gathered
    weights."""
    join(rank, world, port)
    from trainer.strategies.distributed import shutdown_process_group
    from trainer.strategies.fsdp2 import FSDP2TrainStrategy

    batch = tiny_batch(rows=4)
    per = 4 // world
    mine = {k: v[per * rank : per * rank + per] for k, v in batch.items()}
    strategy = FSDP2TrainStrategy(
        tiny_qwen2(), lr=1e-2, micro_batch_size=4, device="cpu", tensor_parallel_size=tp
    )
    out[(rank, "local_rows")] = int(
        strategy.model.model.layers[0].mlp.gate_proj.weight.to_local().shape[0]
    )
    out[(rank, "logprobs")] = strategy.forward(mine).logprobs
    out[(rank, "metrics")] = [strategy.train_step(mine, nll_loss) for _ in range(2)]
    out[(rank, "weights")] = {k: v.clone() for k, v in strategy.full_weights(device="cpu")}
    from trainer.weights.shards import shard_layout

    # what the shared-memory weight sync writes from this rank
    layout = shard_layout(strategy, rank=rank)
    out[(rank, "pieces")] = {
        name: [(index, piece.clone()) for index, piece in pieces]
        for name, pieces in layout.pieces.items()
    }
    out[(rank, "specs")] = [(spec.name, spec.shape) for spec in layout.specs]
    shutdown_process_group()


def lora_model(seed: int = 0) -> Any:
    """``tiny_qwen2`` with rank-4 adapters on every linear layer, initialised from ``seed``."""
    import torch

    from trainer.config import LoraConfig
    from trainer.strategies.lora import apply_lora

    model = tiny_qwen2()
    torch.manual_seed(seed)
    return apply_lora(model, LoraConfig(rank=4))


def fsdp2_lora_rank(rank: int, world: int, port: int, out: Any) -> None:
    """FSDP2 over a LoRA-wrapped model: 2 steps on this rank's half of the batch, the adapters
    gathered, the engine's base tensors, then folding the adapters into the sharded base."""
    join(rank, world, port)
    import torch

    from trainer.strategies.distributed import shutdown_process_group
    from trainer.strategies.fsdp2 import FSDP2TrainStrategy
    from trainer.strategies.lora import adapter_state, engine_weights, fold_adapters

    batch = tiny_batch(rows=4)
    mine = {k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}
    strategy = FSDP2TrainStrategy(lora_model(), lr=1e-2, micro_batch_size=1, device="cpu")
    for _ in range(2):
        strategy.train_step(mine, nll_loss)
    out[(rank, "adapters")] = adapter_state(strategy.model).tensors
    out[(rank, "base")] = {k: v.clone() for k, v in engine_weights(strategy.full_weights("cpu"))}
    before = strategy.forward(batch).logprobs
    fold_adapters(strategy.model, strategy.optimizer)
    after = strategy.forward(batch).logprobs
    with strategy.model.disable_adapter():
        off = strategy.forward(batch).logprobs
    out[(rank, "fold")] = (float((after - before).abs().max()), float((off - before).abs().max()))
    out[(rank, "trainable")] = sorted(
        n for n, p in strategy.model.named_parameters() if p.requires_grad
    )
    torch.distributed.barrier()
    shutdown_process_group()


def temperature_rank(
    rank: int, world: int, port: int, out: Any, name: str, temperature: float, pp: int = 1
) -> None:
    """``name`` (fsdp2 or megatron, ``pp`` pipeline stages) at a sampling ``temperature``: this
    rank's rows' log-probs and entropy, and the NLL one train step sees (at that temperature)."""
    join(rank, world, port)
    import warnings

    warnings.filterwarnings("ignore")
    from trainer.strategies.distributed import shutdown_process_group
    from trainer.strategies.registry import make_train_strategy

    per = 4 // world
    mine = {k: v[per * rank : per * rank + per] for k, v in tiny_batch(rows=4).items()}
    layout = {"pipeline_parallel_size": pp} if pp > 1 else {}
    strategy = make_train_strategy(
        name,
        tiny_qwen2(layers=4),
        world_size=world,
        strategy_args={"device": "cpu", **layout},
        lr=1e-2,
        micro_batch_size=1,
    )
    forward = strategy.forward(mine, with_entropy=True, temperature=temperature)
    out[(rank, "logprobs")], out[(rank, "entropy")] = forward.logprobs, forward.entropy
    out[(rank, "metrics")] = strategy.train_step(mine, nll_loss, temperature=temperature)
    shutdown_process_group()
