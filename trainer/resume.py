"""What ``--resume`` takes from the checkpoint, what from the config as given now, and what it
refuses to change.

A resumed run continues the saved weights, optimizer moments, RNG states and step, and runs
the config as given now (``envhub train ... train.steps=200 --resume`` extends a run; the CLI
lists every setting that differs first). Three rules make that true and safe:

1. **Optimizer settings come from the config.** The optimizer's saved param-group settings
   (``lr``, ``weight_decay``, ``betas``, ``eps``) would otherwise win over the config when its
   state is loaded: :func:`keep_optimizer_settings` puts back the ones the strategy was built
   with (the config's; a scheduled learning rate is then set per step from the step alone).
2. **A state is loaded only by the strategy and layout that saved it.** Optimizer state is
   laid out per strategy (parameter ids, FQNs, per-rank shards): :func:`strategy_stamp` records
   the saving strategy in its state and :func:`check_saved_strategy` refuses another one
   naming the setting to put back, instead of dropping the optimizer state or failing deep
   inside torch.
3. **Settings that change the shape of a saved state are refused up front**
   (:func:`resume_conflicts`): the model (any ``model.tiny`` setting: the run would go on
   training the tiny model it built, ``{output_dir}/initial_policy``; a ``model.path`` at
   another model, told by :func:`model_identity`: architecture, sizes, vocabulary, tokenizer
   files; the same model moved to another folder resumes), LoRA on/off, its rank and targets,
   the number of inference engine ranks (whose sampling RNG states are saved one per
   rank), and a role whose state the run never saved: a critic (GAE after GRPO), or a KL term
   added to a warm-started run (its anchor, the warm-started policy, was not kept). A
   checkpoint without its ``config.json`` is refused: these checks need it.
4. **A run continues only itself.** Each run has an id (``{output_dir}/run.json``, and every
   checkpoint's ``meta.json``); a checkpoint of another run is refused, and a fresh start into
   a checkpoint folder that holds checkpoints is refused (:func:`start_run`).
5. **A resumed run goes forward.** ``train.steps`` counts every step of the run: below the
   checkpoint's step it is refused up front (:func:`steps_behind`); equal to it the run is
   complete, and nothing is built unless the final policy is missing (a kill between the last
   checkpoint and it: :func:`wrote_final_policy`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.errors import CheckpointError

if TYPE_CHECKING:
    from trainer.checkpoint_read import Checkpoint

__all__ = [
    "RUN_FILE",
    "RUN_LOCK",
    "ResumePoint",
    "check_saved_strategy",
    "keep_optimizer_settings",
    "model_identity",
    "resume_conflicts",
    "run_id_of",
    "start_run",
    "steps_behind",
    "strategy_stamp",
    "write_run_id",
    "wrote_final_policy",
]

_HYPERPARAMETERS = ("lr", "weight_decay", "betas", "eps")


@contextmanager
def keep_optimizer_settings(optimizer: Any) -> Iterator[None]:
    """Load optimizer state inside this block: the param groups keep the ``lr``,
    ``weight_decay``, ``betas`` and ``eps`` they had before it (rule 1)."""
    before = [
        {key: group[key] for key in _HYPERPARAMETERS if key in group}
        for group in optimizer.param_groups
    ]
    yield
    for group, settings in zip(optimizer.param_groups, before, strict=True):
        group.update(settings)


def strategy_stamp(name: str, layout: Mapping[str, int] | None = None) -> dict[str, Any]:
    """What a strategy adds to its ``state_dict``: its name and the layout its state needs."""
    return {"strategy": name, "layout": dict(layout or {})}


def _saved_strategy(state: Mapping[str, Any]) -> str | None:
    """The strategy that saved ``state`` (inferred for states saved before the stamp)."""
    if "strategy" in state:
        return str(state["strategy"])
    if "optimizer_ranks" in state:
        return "megatron"
    entries = (state.get("optimizer") or {}).get("state") or {}
    if entries:  # torch keys its state by parameter index; DCP's full state dict by FQN
        return "fsdp2" if isinstance(next(iter(entries)), str) else "hf"
    return None


def check_saved_strategy(
    state: Mapping[str, Any],
    name: str,
    layout: Mapping[str, int] | None = None,
    *,
    role: str | None = None,
) -> None:
    """Refuse ``state`` unless strategy ``name`` saved it and, when ``layout`` is given, with that
    layout (rule 2); the message names ``roles.<role>.strategy`` (any role when ``role`` is
    None)."""
    saved = _saved_strategy(state)
    where = f"roles.{role or '<role>'}"
    if saved is not None and saved != name:
        raise CheckpointError(
            f"the checkpoint's training state was saved by the {saved!r} strategy, but this run "
            f"trains with {name!r}: its optimizer state cannot be carried across strategies. "
            f"Resume with {where}.strategy={saved} (or start a fresh run to switch strategy)"
        )
    if layout is None:  # (the strategy itself checks its layout)
        return
    saved_layout = dict(state.get("layout") or {})
    changed = {
        key: (value, layout.get(key))
        for key, value in saved_layout.items()
        if layout.get(key) != value
    }
    if changed:
        settings = ", ".join(
            f"{key} {old} (now {new})" for key, (old, new) in sorted(changed.items())
        )
        raise CheckpointError(
            f"the checkpoint's {name} state was saved with {settings}: its optimizer shards fit "
            f"only that layout. Resume with the same {where}.device_mapping and "
            f"{where}.strategy_args as the saved run"
        )


def _get(tree: Mapping[str, Any] | None, path: str) -> Any:
    node: Any = tree
    for key in path.split("."):
        if not isinstance(node, Mapping):
            return None
        node = node.get(key)
    return node


_SHAPE_SETTINGS = ("model.lora.rank", "model.lora.target_modules")
_NO_CONFIG = (
    "config.json: the checkpoint has none (deleted, or saved without it), and the checks of the "
    "settings its states need (the model, LoRA) read it; copy it back from an older checkpoint "
    "of this run, or start a new run (another output_dir)"
)
_NEW_RUN = "or start a new run (another output_dir) to train another model"
_IDENTITY_KEYS = (
    "model_type",
    "hidden_size",
    "n_embd",
    "num_hidden_layers",
    "n_layer",
    "num_attention_heads",
    "n_head",
    "num_key_value_heads",
    "intermediate_size",
    "n_inner",
    "vocab_size",
    "n_positions",
    "tie_word_embeddings",
)
"""The entries of a model's config.json that tell it apart (its weights' shapes)."""
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt")


def model_identity(folder: Path) -> dict[str, Any] | None:
    """What identifies the model in ``folder`` (cheap: its config.json and a hash of its
    tokenizer files, no weights read); None when it has no readable config.json."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    identity = {key: config[key] for key in _IDENTITY_KEYS if key in config}
    digest = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        if (folder / name).is_file():
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    identity["tokenizer"] = digest.hexdigest()[:16]
    return identity


def _model_folder(config: Mapping[str, Any], output_dir: Path) -> Path:
    """The folder the run of ``config`` loads its model from (``roles.prepare_policy``)."""
    path = _get(config, "model.path")
    return Path(os.path.abspath(Path(path).expanduser())) if path else output_dir / "initial_policy"


def _model_conflicts(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """The model of ``now`` unless it is the one the checkpoint's weights belong to (rule 3)."""
    tiny_then, tiny_now = _get(saved, "model.tiny"), _get(now, "model.tiny")
    if isinstance(tiny_then, Mapping) and isinstance(tiny_now, Mapping):
        return [
            f"model.tiny.{key}: {tiny_then.get(key)!r} in the checkpoint, {tiny_now.get(key)!r} "
            f"now (the run trains the model it built then); resume with "
            f"model.tiny.{key}={tiny_then.get(key)}, {_NEW_RUN}"
            for key in sorted(set(tiny_then) | set(tiny_now))
            if tiny_then.get(key) != tiny_now.get(key)
        ]
    output_dir = Path(os.path.abspath(str(_get(now, "output_dir"))))
    then, later = _model_folder(saved, output_dir), _model_folder(now, output_dir)
    if then == later:
        return []
    setting = "model.path" if _get(now, "model.path") else "model.tiny"
    restore = (
        f"model.path={_get(saved, 'model.path')}" + (" model.tiny=null" if tiny_now else "")
        if _get(saved, "model.path")
        else "model.path=null and model.tiny as saved"
    )
    saved_id, now_id = model_identity(then), model_identity(later)
    if saved_id is None or now_id is None:
        missing = then if saved_id is None else later
        return [
            (
                f"{setting}: the run was saved with the model in {then}; {missing} holds no model "
                f"(yet), so the model now cannot be checked to be that one; resume with {restore}, "
                f"{_NEW_RUN}"
            )
        ]
    differ = [
        f"{key} {saved_id.get(key)} in the saved model, {now_id.get(key)} in this one"
        if key != "tokenizer"
        else "the tokenizer files differ"
        for key in sorted(set(saved_id) | set(now_id))
        if saved_id.get(key) != now_id.get(key)
    ]
    if not differ:  # the same model in another folder
        return []
    return [
        (
            f"{setting}: {later} is another model than the one the run was saved with ({then}): "
            f"{'; '.join(differ)}; resume with {restore}, {_NEW_RUN}"
        )
    ]


def resume_conflicts(
    saved: Mapping[str, Any] | None,
    now: Mapping[str, Any],
    *,
    engine_ranks: tuple[int, int] | None = None,
) -> list[str]:
    """The settings of ``now`` (a dumped config) that a checkpoint saved under ``saved`` cannot
    be loaded with, one line each naming the setting and both values (rule 3); ``engine_ranks``:
    ``(saved, now)`` numbers of inference engine ranks."""
    if saved is None:
        return [_NO_CONFIG]
    problems = _model_conflicts(saved, now)
    lora_then, lora_now = _get(saved, "model.lora"), _get(now, "model.lora")
    if saved is not None and (lora_then is None) != (lora_now is None):
        then, later = ("on", "off") if lora_then is not None else ("off", "on")
        problems.append(
            f"model.lora: the run was saved with LoRA {then}, it is {later} now (adapter "
            f"weights {'are' if lora_then is not None else 'are not'} in the checkpoint); "
            + (
                f"resume with model.lora as saved ({lora_then!r})"
                if lora_then is not None
                else "resume without model.lora (unset it, or model.lora.rank=0)"
            )
        )
    elif saved is not None and lora_then is not None:
        for path in _SHAPE_SETTINGS:
            if _get(saved, path) != _get(now, path):
                problems.append(
                    f"{path}: {_get(saved, path)!r} in the checkpoint, {_get(now, path)!r} now "
                    f"(the adapters' shapes differ); resume with {path}={_get(saved, path)!r}"
                )
    problems += _algorithm_conflicts(saved, now)
    if engine_ranks is not None and engine_ranks[0] != engine_ranks[1]:
        mapping = _get(saved, "roles.actor_infer.device_mapping")
        problems.append(
            f"roles.actor_infer.device_mapping: the run was saved with {engine_ranks[0]} "
            f"inference rank(s){f' ({mapping})' if mapping is not None else ''}, this one has "
            f"{engine_ranks[1]}; each rank's sampling state is saved on its own, so resume with "
            "the saved device_mapping"
        )
    return problems


def _algorithm_conflicts(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """A role ``now`` needs whose saved state the checkpoint cannot hold (rule 3): a critic (GAE)
    the run did not train, and a KL term the run did not have after a warm start. A fresh run
    anchors the KL to its warm-started policy (``Roles.adopt_warm_start``), which is saved only
    when a KL term needs it; without it the resumed reference would be the untrained initial
    policy. As in verl and ROLL, the reference is never silently another model than the one RL
    started from. Settings saved by an older version (absent) are not refused."""
    problems = []
    estimator = _get(saved, "algorithm.advantage_estimator")
    if (
        estimator is not None
        and estimator != "gae"
        and _get(now, "algorithm.advantage_estimator") == "gae"
    ):
        problems.append(
            f"algorithm.advantage_estimator: the run was saved with {estimator} (no critic: no "
            "value model in the checkpoint), it is gae now; resume with "
            f"algorithm.advantage_estimator={estimator}, or start a new run (another output_dir) "
            "to train with a critic"
        )
    kl_then, kl_now = _get(saved, "algorithm.loss.kl_coef"), _get(now, "algorithm.loss.kl_coef")
    warm_started = (_get(saved, "sft.epochs") or 0) > 0
    if kl_then == 0 and (kl_now or 0) > 0 and warm_started and _get(now, "model.lora") is None:
        problems.append(
            f"algorithm.loss.kl_coef: the run was saved without a KL term, it is {kl_now} now; a "
            f"KL term measures against the warm-started policy (sft.epochs="
            f"{_get(saved, 'sft.epochs')}), which a run without one does not save, so the resumed "
            "run would pull towards the untrained initial policy instead; resume with "
            "algorithm.loss.kl_coef=0, or start a new run (another output_dir) with the KL term"
        )
    return problems


def steps_behind(done: int, steps: int) -> str | None:
    """Why ``train.steps`` = ``steps`` cannot resume a checkpoint of step ``done`` (rule 5), naming
    the fix; None when it can."""
    if steps >= done:
        return None
    return (
        f"train.steps={steps} is below the {done} steps the run already did; raise train.steps "
        f"above {done} to train further (it counts every step of the run, not the steps left)"
    )


def refuse_unresumable(
    checkpoint: Checkpoint, now: Mapping[str, Any], *, engine_ranks: tuple[int, int] | None = None
) -> None:
    """Raise ``CheckpointError`` when ``checkpoint`` cannot be resumed under ``now`` (a dumped
    config): every setting ``resume_conflicts`` names, and ``train.steps`` below the steps done
    (``steps_behind``; alone, it is one line). ``envhub train --resume`` and the Python API
    call it before building anything, the run again once its engines tell ``engine_ranks``."""
    conflicts = resume_conflicts(checkpoint.config, now, engine_ranks=engine_ranks)
    behind = steps_behind(checkpoint.step, int(_get(now, "train.steps")))
    if behind and not conflicts:
        raise CheckpointError(f"cannot resume from {checkpoint.path}: {behind}")
    conflicts += [behind] if behind else []
    if conflicts:
        raise CheckpointError(
            f"cannot resume from {checkpoint.path} with this config:\n"
            + "\n".join(f"  - {line}" for line in conflicts)
        )


@dataclass(frozen=True)
class ResumePoint:
    """What ``--resume`` would continue (``envhub train`` finds it before building anything)."""

    checkpoint: Path | None
    """The run's latest checkpoint; None for one a kill left half saved (the run puts it back)."""
    step: int
    """The steps the run already did (0 when ``checkpoint`` is None: not known yet)."""
    drift: list[str]
    """Warning lines: the settings that differ from the checkpoint's config, what the checkpoint
    lacks that a resume can do without, ``step_N`` links that are ignored."""

    def describe(self, cfg: Any) -> tuple[str, bool]:
        """What resuming under ``cfg`` does, in one line, and whether it builds the run: not when
        the run is complete (``train.steps`` done and its final policy written: rule 5)."""
        out, steps, checkpoint = Path(cfg.output_dir), cfg.train.steps, self.checkpoint
        if checkpoint is None:
            return (
                f"resume: from the checkpoint a kill left half saved in {cfg.checkpoint_dir}",
                True,
            )
        if self.step < steps:
            first = self.step + 1
            span = f"step {first}" if first == steps else f"steps {first}-{steps}"
            return (
                f"resume: from {checkpoint} (step {self.step}): {span} of train.steps={steps}",
                True,
            )
        done = f"the run in {out} already did all its train.steps={steps} steps ({checkpoint.name})"
        if wrote_final_policy(out, checkpoint):
            fix = f"raise train.steps above {steps} to train further"
            return f"nothing to resume: {done} and wrote its final policy; {fix}", False
        return f"resume: {done}; it only writes its final policy (it stopped before that)", True


def wrote_final_policy(output_dir: Path, checkpoint: Path) -> bool:
    """Whether ``output_dir/final_policy`` was written after ``checkpoint`` was saved: the run
    ended there (rule 5). A run writes it after its last checkpoint; one killed in between has
    none, or the one of an earlier end (before ``train.steps`` was raised)."""
    try:
        saved = (checkpoint / "meta.json").stat().st_mtime_ns  # written last, then renamed
        written = [p.stat().st_mtime_ns for p in (output_dir / "final_policy").iterdir()]
    except OSError:
        return False
    return bool(written) and min(written) >= saved


RUN_FILE = "run.json"
"""``{output_dir}/run.json``: the run's id, also written into each of its checkpoints."""
RUN_LOCK = ".run.lock"
"""``{output_dir}/.run.lock``: held by the run writing the folder (``FolderLock``)."""


def run_id_of(output_dir: Path) -> str | None:
    """The id in ``output_dir/run.json`` (None for a run older than run ids, or none yet)."""
    try:
        found = json.loads((output_dir / RUN_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return str(found) if found else None


def write_run_id(output_dir: Path, run_id: str) -> None:
    """Record ``run_id`` as ``output_dir``'s run (atomically)."""
    tmp = output_dir / f".{RUN_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps({"run_id": run_id, "started": time.time()}) + "\n")
    os.replace(tmp, output_dir / RUN_FILE)


def start_run(output_dir: Path, checkpoint_dir: Path, *, resume: bool) -> str | None:
    """The run id of a run about to start in ``output_dir``: its recorded one on ``--resume``
    (None when it has none: the checkpoint's is adopted on load), a new one on a fresh start,
    which is refused when ``checkpoint_dir`` already holds checkpoints (of another run: a later
    ``--resume`` would continue that one)."""
    if resume:
        return run_id_of(output_dir)
    from trainer.checkpoint import CheckpointManager

    found = CheckpointManager(checkpoint_dir, lock=False).list() if checkpoint_dir.is_dir() else []
    if found:
        raise CheckpointError(
            f"checkpoint.dir {checkpoint_dir} already holds checkpoints ({found[-1].name}, of "
            "an earlier run); a fresh run would mix its checkpoints with them. Continue that "
            "run with --resume, or move them away (envhub train moves a previous run aside "
            "itself) or choose another checkpoint.dir"
        )
    run_id = uuid.uuid4().hex[:12]
    write_run_id(output_dir, run_id)
    return run_id
