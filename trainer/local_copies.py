"""The envs a run plays in its own process even with ``env.hub``: they must be the hub's.

Two things need an env the driver plays itself: the warm start's expert demonstrations
(``sft.source: expert``; a hub sends no expert moves) and ``model.tiny``'s tokenizer, learnt on
the env's own texts (expert and random moves). Both play ``envhub.make(id, **env.kwargs_for(id))``
here. With a hub, ``env.kwargs`` must be empty (kwargs cannot travel: the hub builds its envs
with those it was started with, ``envhub serve -k``), so that local copy has the env's
registered defaults, which need not be what the hub serves: the warm start then taught another
task (another map size, another answer format) while RL played the hub's, and nothing said so.

``check_local_copies`` compares the two before anything is built: the first observations and
tools of the seeds the local copy starts with, and the turn limit. A difference is refused,
naming it and the fixes: serve the id with its defaults, or register a variant id with the
served kwargs and serve and train on that id (the local copy is then made from the same id);
or play no local copy (``sft.epochs=0``, ``sft.source: file``, ``model.path``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.errors import ConfigError, Problem

if TYPE_CHECKING:
    from trainer.config import TrainerConfig

__all__ = ["check_local_copies"]


def check_local_copies(cfg: TrainerConfig, *, warm_start: bool) -> None:
    """Refuse (``ConfigError`` at ``env.hub``) a run whose local copies of its envs differ from
    the envs ``env.hub`` serves. ``warm_start``: the run will warm-start (not a ``--resume``).
    Nothing is asked of the hub when the run plays no local copy."""
    env = cfg.env
    if env.hub is None:
        return
    uses, fixes = [], []
    if warm_start and cfg.sft.epochs > 0 and cfg.sft.source == "expert":
        uses.append("the warm start's expert demonstrations")
        fixes.append("sft.epochs=0 (no warm start) or sft.source: file with sft.path")
    if cfg.model.tiny is not None and not (Path(cfg.output_dir) / "initial_policy").is_dir():
        uses.append("model.tiny's tokenizer")
        fixes.append("model.path (a checkpoint of your own) instead of model.tiny")
    if not uses:
        return
    from trainer.sft import SFT_SEED_BASE

    for env_id in env.ids:
        kwargs = env.kwargs_for(env_id)
        difference = _difference(env_id, kwargs, env.hub, env.token, (SFT_SEED_BASE, cfg.seed))
        if difference is None:
            continue
        made = ", ".join([repr(env_id), *(f"{k}={v!r}" for k, v in kwargs.items())])
        raise ConfigError(
            [
                Problem(
                    "env.hub",
                    f"{env_id} as the hub {env.hub} serves it differs from this run's local "
                    f"copy, which makes {' and '.join(uses)} (a hub sends no expert moves, and "
                    f"env kwargs cannot travel: the copy is envhub.make({made}), the env's "
                    "registered defaults): "
                    f"{difference}. Serve {env_id} with its defaults (no -k), or register a "
                    "variant id with the kwargs the hub serves (envhub.register(..., variants="
                    "{NAME: {...}}) in a module given to both commands with --import) and serve "
                    f"and train on that id; or play no local copy: {'; '.join(fixes)}",
                )
            ]
        )


def _difference(
    env_id: str, kwargs: dict[str, Any], hub: str, token: str | None, seeds: tuple[int, ...]
) -> str | None:
    """How ``env_id`` made here with ``kwargs`` differs from the one ``hub`` serves, in one
    clause (None: the same first observations, tools and turn limit at ``seeds``)."""
    import envhub

    local = envhub.make(env_id, **kwargs)
    try:
        remote = envhub.make(env_id, hub=hub, token=token)
        try:
            for seed in seeds:
                here, here_info = local.reset(seed=seed)
                there, there_info = remote.reset(seed=seed)
                if _plain(here) != _plain(there):
                    return f"its first observation at seed {seed} differs: {_where(here, there)}"
                if _plain(here_info.get("tools")) != _plain(there_info.get("tools")):
                    return f"its tools differ (at seed {seed})"
            limits = getattr(local.unwrapped, "max_turns", None), remote.max_turns
            if limits[0] != limits[1]:
                return f"max_turns is {limits[0]} here and {limits[1]} on the hub"
        finally:
            remote.close()
    finally:
        local.close()
    return None


def _plain(value: Any) -> Any:
    """``value`` as it travels (JSON), so a local observation compares with the hub's."""
    return json.loads(json.dumps(value, default=str))


def _where(here: Any, there: Any) -> str:
    """Where two observations first differ, as a short excerpt of each."""
    a, b = json.dumps(_plain(here)), json.dumps(_plain(there))
    at = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    start = max(0, at - 30)
    return f"here ...{a[start : at + 40]}... vs on the hub ...{b[start : at + 40]}..."
