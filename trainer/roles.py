"""Turn a config into running roles: the policy folder and the clusters.

``prepare_policy`` resolves ``model.path`` (checked to exist) or builds the tiny policy of
``model.tiny`` once into ``{output_dir}/initial_policy`` (reused on ``--resume``, which
refuses a changed ``model.tiny`` or another model: ``trainer.resume``), so every
role then loads the same folder through ``from_pretrained``. ``start_roles`` creates one
cluster per active role: in-process workers (``cluster.backend: local``) placed by the
config's device plan, or Ray actors in placement groups from a ``ResourceManager``. The actor
and the reference take their log-probs at ``rollout.temperature``, the one the engines sample at
(never ``eval.temperature``: evaluation episodes are not trained on). Every role is given
``model.dtype``: the engines and the frozen reference hold it, while the roles that train keep
fp32 master weights and compute in it (``workers.strategy_worker.master_dtype``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.errors import ModelError

if TYPE_CHECKING:
    from trainer.config import TrainerConfig
    from trainer.workers.actor import ActorCluster
    from trainer.workers.critic import CriticCluster
    from trainer.workers.infer import InferCluster
    from trainer.workers.reference import ReferenceCluster

__all__ = ["Roles", "prepare_policy", "start_roles", "stop_all"]

_log = logging.getLogger(__name__)


def prepare_policy(cfg: TrainerConfig) -> Path:
    """The folder every role loads the policy from (built once for ``model.tiny``)."""
    if cfg.model.path is not None:
        path = Path(cfg.model.path).expanduser()
        if not (path / "config.json").is_file():
            raise ModelError(
                f"model.path {cfg.model.path!r} is not a model folder (no config.json there); "
                "point it at a local save_pretrained checkpoint (e.g. a downloaded "
                "Qwen2.5-0.5B-Instruct) or use model.tiny to build one"
            )
        return path
    from trainer.models import build_policy, env_corpus

    target = Path(cfg.output_dir) / "initial_policy"
    if (target / "config.json").is_file():
        return target
    tiny = cfg.model.tiny
    if tiny is None:  # the config validator requires path or tiny; kept for readers
        raise ModelError("set model.path or model.tiny")
    corpus: list[str] = []
    for env_id in cfg.env.ids:
        corpus += env_corpus(env_id, cfg.env.kwargs_for(env_id), episodes=300, seed=cfg.seed)
    partial = target.with_name(target.name + ".partial")
    build_policy(
        partial,
        corpus,
        tokenizer_kind=tiny.tokenizer,
        vocab_size=tiny.vocab_size,
        arch=tiny.architecture,
        hidden_size=tiny.hidden_size,
        num_layers=tiny.num_layers,
        num_heads=tiny.num_heads,
        num_kv_heads=tiny.num_kv_heads,
        intermediate_size=tiny.intermediate_size,
        max_positions=tiny.max_position_embeddings,
        seed=cfg.seed,
    )
    partial.rename(target)
    return target


@dataclass
class Roles:
    """The running clusters of one run (absent roles are None)."""

    actor: ActorCluster
    infer: InferCluster
    reference: ReferenceCluster | None = None
    critic: CriticCluster | None = None
    resources: Any = None
    clusters: list[Any] = field(default_factory=list)
    adapter_reference: bool = False
    """LoRA with a KL term: the reference is the actor with its adapters off (no workers)."""

    def reference_logprobs(self, batch: Any) -> Any:
        """The reference policy's log-probs of ``batch`` (None when no KL term needs them)."""
        if self.reference is not None:
            return self.reference.compute_logprobs(batch)["ref_logprobs"]
        if self.adapter_reference:
            return self.actor.compute_ref_logprobs(batch)["ref_logprobs"]
        return None

    def adopt_warm_start(self, *, reset_optimizer: bool = False) -> None:
        """The warm-started policy becomes the reference the KL term measures against: the
        reference workers load it, or (LoRA) the adapters are folded into the base, which the
        adapters-off reference then is, and RL starts from fresh adapters and moments. After a
        full-weight warm start RL continues its AdamW moments unless ``reset_optimizer``
        (``sft.reset_optimizer``) drops them and their step counts."""
        if self.actor.uses_lora():
            self.actor.fold_adapters()
        elif self.reference is not None:
            self.reference.load_weights(self.actor.get_weights())
        if reset_optimizer:
            self.actor.reset_optimizer()

    def shutdown(self) -> None:
        """Stop every cluster, then release the placement groups (``stop_all``)."""
        stop_all(self.clusters, self.resources)


def stop_all(clusters: list[Any], resources: Any) -> None:
    """Stop each of ``clusters``, then release ``resources`` (the placement groups), even when
    one of them fails to stop: a failure must not leak the workers after it. The first failure
    is raised once all ran (any later ones are logged)."""
    failures: list[Exception] = []
    try:
        for cluster in clusters:
            try:
                cluster.shutdown()
            except Exception as error:  # noqa: BLE001 - the next clusters still stop
                if failures:
                    _log.error("stopping %r failed too", cluster, exc_info=error)
                failures.append(error)
    finally:
        if resources is not None:
            resources.shutdown()
    if failures:
        raise failures[0]


def start_roles(cfg: TrainerConfig, model_path: Path) -> Roles:
    """Create the clusters of ``cfg.active_roles`` on the configured backend."""
    from trainer.controller.resources import resources_for
    from trainer.workers.actor import ActorCluster
    from trainer.workers.critic import CriticCluster
    from trainer.workers.infer import InferCluster
    from trainer.workers.reference import ReferenceCluster

    resources = resources_for(cfg)  # None on the local backend; joins or starts Ray (the one way)
    plan = resources.plan if resources is not None else cfg.device_plan
    common = {"model_path": str(model_path), "dtype": cfg.model.dtype}
    clusters: list[Any] = []

    def start(cls: type, role: str, **kwargs: Any) -> Any:
        placement_kwargs = (
            {"resources": resources} if resources is not None else {"placement": plan.roles[role]}
        )
        cluster = cls(
            role,
            getattr(cfg.roles, role),
            backend=cfg.cluster.backend,
            worker_kwargs=kwargs,
            **placement_kwargs,
        )
        clusters.append(cluster)
        return cluster

    try:
        actor = start(
            ActorCluster,
            "actor_train",
            **common,
            seed=cfg.seed,
            optim=cfg.train.options(cfg.policy_lr),
            loss=cfg.algorithm.loss,
            temperature=cfg.rollout.temperature,
            lora=cfg.model.lora,
            full_warm_start=(
                cfg.model.lora is not None
                and cfg.model.lora.warm_start == "full"
                and cfg.sft.epochs > 0
            ),
        )
        lora = cfg.model.lora
        adapter_rank = lora.rank if lora is not None and lora.sync == "adapter" else None
        infer = start(
            InferCluster, "actor_infer", **common, seed=cfg.seed, adapter_rank=adapter_rank
        )
        reference = (
            start(
                ReferenceCluster,
                "reference",
                **common,
                micro_batch_size=cfg.train.micro_batch_size,
                temperature=cfg.rollout.temperature,
            )
            if "reference" in cfg.active_roles
            else None
        )
        critic = (
            start(
                CriticCluster,
                "critic",
                **common,
                seed=cfg.seed,
                optim=cfg.train.options(cfg.train.critic_lr),
            )
            if "critic" in cfg.active_roles
            else None
        )
    except BaseException as error:
        try:
            stop_all(clusters, resources)
        except Exception:  # noqa: BLE001 - the build's error is the one to see
            _log.exception("stopping the roles after a failed start failed (%s)", error)
        raise
    adapter_reference = cfg.model.lora is not None and cfg.algorithm.needs_reference
    return Roles(actor, infer, reference, critic, resources, clusters, adapter_reference)
