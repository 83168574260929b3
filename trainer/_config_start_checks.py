"""What a run's start needs of the files and envs its config names, checked where the config
loads (``TrainerConfig.problems()``, so ``--dry-run`` refuses it too), not after the workers
started with a library's own message:

- ``model.path``'s tokenizer renders chats: it has tokenizer files and a chat template, or
  ``model.chat_template`` gives one (``trainer.models.tokenizer_problem``; the driver's renderer
  then loads it through ``trainer.models.load_tokenizer``, which says the same);
- a warm start that plays the envs' expert (``sft.source: expert``) has an expert to play: an
  env class that does not implement ``expert_action()`` has none (an entry point that is a
  function hides its class; ``trainer.sft.expert_trajectories`` says it as it plays);
- vLLM on CPU (``rollout.engine: vllm``, devices that are not GPUs, none on this machine) takes
  the model's attention head size: ``trainer.strategies.vllm_platform.check_cpu_head_size``,
  which the engine runs as it starts, on the config ``model.tiny`` builds or ``model.path``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.errors import Problem

if TYPE_CHECKING:
    from trainer.config import TrainerConfig

__all__ = ["start_problems"]


def start_problems(cfg: TrainerConfig) -> list[Problem]:
    """Every problem of ``cfg``'s start this module checks (empty when fine)."""
    return [*_tokenizer_problems(cfg), *_expert_problems(cfg), *_vllm_cpu_problems(cfg)]


def _tokenizer_problems(cfg: TrainerConfig) -> list[Problem]:
    if cfg.model.path is None:  # model.tiny: built with its tokenizer and template
        return []
    from trainer.models import tokenizer_problem

    problem = tokenizer_problem(cfg.model.path, cfg.model.chat_template)
    return [Problem("model.path", problem)] if problem else []


def _expert_problems(cfg: TrainerConfig) -> list[Problem]:
    sft = cfg.sft
    if sft.epochs == 0 or sft.source != "expert":
        return []
    import envhub
    from envhub.core import TextEnv

    lacking = []
    for env_id in cfg.env.ids:
        try:
            entry = envhub.spec(env_id).load_entry_point()
        except Exception:  # noqa: BLE001, S112 - an id or entry point the env checks report
            continue
        if isinstance(entry, type) and getattr(entry, "expert_action", None) is (
            TextEnv.expert_action
        ):
            lacking.append((env_id, entry.__name__))
    return [
        Problem(
            "sft.source",
            f"expert plays each env's expert_action() to make the warm start's demonstrations, "
            f"and {env_id} has no expert (its class {name} does not implement expert_action()); "
            "set sft.epochs=0 to skip the warm start, or sft.source: file with sft.path (a JSONL "
            "of demonstrations)",
        )
        for env_id, name in lacking
    ]


def _vllm_cpu_problems(cfg: TrainerConfig) -> list[Problem]:
    engines = {cfg.rollout.engine, cfg.roles.actor_infer.strategy}  # two: refused elsewhere
    if engines != {"vllm"} or cfg.cluster.device_resource == "GPU":
        return []
    from trainer import devices

    if devices.local_gpu_count() > 0:  # the engine may find a GPU here: it checks as it starts
        return []
    from trainer._config_checks import _policy_config
    from trainer.errors import ModelError
    from trainer.strategies.vllm_platform import check_cpu_head_size

    policy = _policy_config(cfg)
    try:
        check_cpu_head_size(vars(policy) if policy is not None else {})
    except ModelError as error:
        return [Problem("rollout.engine", str(error))]
    return []
