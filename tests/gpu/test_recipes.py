"""The ``gpu`` tier: one training step of every shipped GPU recipe, with a random model of the
recipe's checkpoint shape, on this machine's GPUs. Run it on a GPU machine with ``pytest -m gpu``
(deselected by default; skipped, with the reason, without CUDA).

A recipe is an ``examples/*.yaml`` that trains a real checkpoint (``model.path``; the CPU
examples build ``model.tiny``). Each runs through ``envhub train``, as its first line says,
with only these changes: ``model.path`` is a random model of the checkpoint's shape
(``tests.gpu.recipe_models``: nothing can be downloaded), ``train.steps=1``, two groups per step
and two evaluation episodes (one step stays a few minutes; the turn, token and micro-batch
limits that decide memory are the recipe's own), and the recipe's device ids are mapped onto
the GPUs present when it asks for more. What must hold is what a user of the recipe would see:
the run exits 0, logs steps 0 and 1 with a finite gradient norm and an evaluation, checkpoints
step 1, and writes a final policy of the checkpoint's shape.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(
    p
    for p in (REPO / "examples").glob("*.yaml")
    if (yaml.safe_load(p.read_text()).get("model") or {}).get("path")
)
"""The shipped GPU recipes: examples that train a real checkpoint."""


def cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        cuda_devices() == 0,
        reason="needs a CUDA GPU: torch.cuda.is_available() is False here "
        "(the gpu tier runs with `pytest -m gpu` on a GPU machine)",
    ),
]


def recipe_overrides(
    recipe: dict[str, Any], policy: Path, out: Path, num_devices: int
) -> list[str]:
    """The changes to ``recipe`` the module docstring lists, as ``envhub train`` overrides."""
    overrides = [
        f"model.path={policy}",
        f"output_dir={out}",
        "train.steps=1",
        "env.num_groups=2",
        "eval.episodes=2",
        "logging.progress=false",
    ]
    for name, role in (recipe.get("roles") or {}).items():
        mapping = role.get("device_mapping")
        if mapping and max(mapping) >= num_devices:
            fitted = [d for d in mapping if d < num_devices] or [0]
            overrides.append(f"roles.{name}.device_mapping=[{','.join(map(str, fitted))}]")
    return overrides


def shape_of(recipe_path: Path) -> dict[str, Any]:
    from tests.gpu.recipe_models import SHAPES

    [shape] = [shape for prefix, shape in SHAPES.items() if recipe_path.name.startswith(prefix)]
    return shape


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("recipe_path", RECIPES, ids=[p.stem for p in RECIPES])
def test_one_step_of_the_recipe_with_a_random_model_of_its_shape(
    recipe_path: Path, tmp_path: Path
) -> None:
    from tests.gpu.recipe_models import random_policy

    recipe = yaml.safe_load(recipe_path.read_text())
    shape = shape_of(recipe_path)
    env = recipe["env"]
    policy = random_policy(
        tmp_path / "policy",
        shape,
        env_id=env["id"],
        env_kwargs=env.get("kwargs"),
        dtype=recipe["model"].get("dtype", "bfloat16"),
    )
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "envhub.cli",
        "train",
        str(recipe_path),
        *recipe_overrides(recipe, policy, out, cuda_devices()),
    ]
    done = subprocess.run(
        command,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1700,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,  # the assert below shows the output
    )
    assert done.returncode == 0, (
        f"{' '.join(command)}\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert math.isfinite(rows[1]["actor/grad_norm"]) and rows[1]["train/episodes"] > 0
    assert rows[1]["eval/success"] is not None
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    saved = json.loads((out / "final_policy" / "config.json").read_text())
    assert {
        k: saved[k]
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    } == {
        k: shape[k]
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    }
