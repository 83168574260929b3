"""``envhub init NAME``: a new environment package that passes ``envhub check`` as written.

The package has one env class (a seeded guessing game showing every part of the contract:
``on_reset``/``on_step``, invalid actions with feedback, an expert and plausible random
actions), the ``envhub.envs`` entry point in its ``pyproject.toml`` (so ``pip install -e``
makes ``NAME/guess-v0`` appear in ``envhub list``, ``envhub.make`` and ``gymnasium.make``),
a test that runs ``envhub check`` on it, and a README saying how to grow it::

    NAME/
      pyproject.toml      the entry point: NAME = "NAME_envs:register"
      README.md
      NAME_envs/__init__.py   register(): the ids
      NAME_envs/guess.py      the env class
      tests/test_envs.py      envhub check NAME/guess-v0
"""

from __future__ import annotations

import re
from pathlib import Path

from envhub.errors import EnvhubError

__all__ = ["ScaffoldError", "scaffold"]

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class ScaffoldError(EnvhubError):
    """The name is not usable, or the target folder already holds files."""


def scaffold(name: str, parent: Path) -> Path:
    """Write the package ``name`` into ``parent / name``; return that folder."""
    if not _NAME.match(name):
        raise ScaffoldError(
            f"{name!r} cannot name an env package: use lower-case letters, digits and '_', "
            "starting with a letter (it becomes the id namespace and the module name), e.g. acme"
        )
    root = parent / name
    if root.exists() and not root.is_dir():
        raise ScaffoldError(f"{root} is a file; pick another name, or another folder with --dir")
    if root.exists() and any(root.iterdir()):
        raise ScaffoldError(f"{root} already exists and is not empty; pick another name or folder")
    files = {
        "pyproject.toml": PYPROJECT,
        "README.md": README,
        f"{name}_envs/__init__.py": INIT,
        f"{name}_envs/guess.py": GUESS,
        "tests/test_envs.py": TEST,
    }
    for relative, template in files.items():
        path = root / relative
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(template.replace("{{name}}", name))
        except OSError as exc:
            raise ScaffoldError(
                f"cannot create {root} ({exc.strerror}: {exc.filename}); pick a folder you can "
                "write to with --dir"
            ) from exc
    return root


PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{{name}}-envs"
version = "0.1.0"
description = "{{name}}'s environments for envhub"
requires-python = ">=3.11"
dependencies = ["envhub"]

[project.optional-dependencies]
test = ["pytest>=8"]

# envhub finds the package's ids through this entry point: after `pip install -e .` they are in
# `envhub list`, `envhub.make` and `gymnasium.make`, with nothing to import.
[project.entry-points."envhub.envs"]
{{name}} = "{{name}}_envs:register"

[tool.setuptools.packages.find]
include = ["{{name}}_envs*"]
"""

README = """\
# {{name}}-envs

Environments for [envhub](https://github.com/envhub/envhub), made with `envhub init {{name}}`.

```bash
pip install -e .                  # registers {{name}}/guess-v0 through the envhub.envs entry point
envhub list --source {{name}}        # the ids this package registers
envhub check {{name}}/guess-v0       # does it keep the TextEnv contract?
envhub play {{name}}/guess-v0        # play it yourself
pytest tests                      # runs envhub check on every id of the package
```

## Grow it

- Change `{{name}}_envs/guess.py`, or add a module with another `envhub.TextEnv` subclass and
  register its id in `{{name}}_envs/__init__.py` (`namespace/name-vN`; variants with `variants=`).
- Draw every random choice from `self.np_random`: the checker plays the same seed twice and
  expects the same episode.
- Answer text you cannot parse with `self.invalid_action(feedback)`; never raise from `on_step`.
- `expert_action()` gives `envhub eval --agent expert` and warm-start data a good move.
- Train on it with `envhub train` by setting `env.id: {{name}}/guess-v0` in a config.
"""

INIT = '''\
"""{{name}}'s envhub environments; envhub calls ``register`` through the entry point."""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register the package's ids (the ``envhub.envs`` entry point in pyproject.toml)."""
    import envhub

    envhub.register(
        "{{name}}/guess-v0",
        entry_point="{{name}}_envs.guess:GuessEnv",
        max_turns=8,
        description="Find a hidden number from higher/lower hints.",
        variants={"hard": {"high": 1000, "max_turns": 12}},
    )
'''

GUESS = '''\
"""A guessing game: the smallest env that shows every part of the TextEnv contract."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

import envhub

_NUMBER = re.compile(r"<answer>\\s*(-?\\d+)\\s*</answer>")


class GuessEnv(envhub.TextEnv):
    """Find a hidden integer in [low, high]; each wrong guess gets a higher/lower hint."""

    system_prompt = "Answer with your guess as <answer>N</answer>."

    def __init__(self, *, low: int = 1, high: int = 100, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # max_turns, render_mode
        if low >= high:
            raise ValueError(f"low must be below high, got low={low}, high={high}")
        self.low, self.high = low, high
        self.secret = low
        self.bounds = (low, high)

    def on_reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self.secret = int(self.np_random.integers(self.low, self.high + 1))  # seeded by reset()
        self.bounds = (self.low, self.high)
        return f"I picked a number from {self.low} to {self.high}. Guess it.", {}

    def on_step(self, action: str) -> envhub.Turn:
        found = _NUMBER.findall(action)
        if not found:
            return self.invalid_action("Write your guess as <answer>N</answer>.")
        guess = int(found[-1])
        if guess == self.secret:
            return envhub.Turn("Correct!", reward=1.0, terminated=True, success=True)
        low, high = self.bounds
        if guess < self.secret:
            self.bounds = (max(low, guess + 1), high)
            return envhub.Turn(f"{guess} is too low.")
        self.bounds = (low, min(high, guess - 1))
        return envhub.Turn(f"{guess} is too high.")

    def expert_action(self) -> str | None:
        low, high = self.bounds
        return None if self.done else f"<answer>{(low + high) // 2}</answer>"

    def sample_action(self, np_random: np.random.Generator) -> str:
        if np_random.random() < 0.2:
            return "Let me think."
        return f"<answer>{int(np_random.integers(self.low, self.high + 1))}</answer>"
'''

TEST = '''\
"""`envhub check` on every id this package registers (run: pytest tests)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import envhub

IDS = [spec.id for spec in envhub.list_envs("{{name}}")]


def test_the_package_registers_its_ids():
    assert "{{name}}/guess-v0" in IDS, "pip install -e . registers them (the entry point)"


@pytest.mark.parametrize("env_id", IDS)
def test_envhub_check_passes(env_id):
    result = subprocess.run(
        [sys.executable, "-m", "envhub.cli", "check", env_id],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_expert_wins():
    env = envhub.make("{{name}}/guess-v0")
    env.reset(seed=0)
    while not env.done:
        *_, info = env.step(env.expert_action())
    assert info["success"]
'''
