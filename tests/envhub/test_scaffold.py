"""`envhub init NAME`: the package it writes installs with `pip install -e` and passes
`envhub check` (and its own test) as written.

The package is installed editable into a fresh virtual environment that sees this one's
packages (a `.pth` line to our site-packages, the effect of `--system-site-packages` for a
venv made from a venv), so pip writes the package's entry point there and nothing touches the
project's own environment. The package's own test then runs from its folder, where only the
install makes `envhub` and its ids importable.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*command: str, cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        list(command),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.timeout(600)
def test_init_writes_a_package_that_installs_and_passes_envhub_check(tmp_path):
    made = run(sys.executable, "-m", "envhub.cli", "init", "acme", "--dir", str(tmp_path))
    assert made.returncode == 0, made.stderr
    package = tmp_path / "acme"
    assert "pip install -e" in made.stdout
    pyproject = (package / "pyproject.toml").read_text()
    assert '[project.entry-points."envhub.envs"]\nacme = "acme_envs:register"' in pyproject

    venv = tmp_path / "venv"
    assert run(sys.executable, "-m", "venv", "--without-pip", str(venv)).returncode == 0
    python = str(venv / "bin" / "python")
    (inner,) = (venv / "lib").glob("python3*/site-packages")
    # `import` lines of a .pth run at start-up: addsitedir also runs the parent's .pth files
    # (envhub's own editable install is one)
    (inner / "parent.pth").write_text(
        "".join(f"import site; site.addsitedir({path!r})\n" for path in site.getsitepackages())
    )
    installed = run(
        python,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-e",
        str(package),
    )
    assert installed.returncode == 0, installed.stderr

    listed = run(python, "-m", "envhub.cli", "list", "--source", "acme")
    assert listed.returncode == 0 and "acme/guess-v0" in listed.stdout, listed.stderr
    checked = run(python, "-m", "envhub.cli", "check", "acme/guess-v0", "acme/guess-hard-v0")
    assert checked.returncode == 0, checked.stdout[-3000:]
    assert "all 2 environment(s) passed" in checked.stdout
    own_test = run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", cwd=package)
    assert own_test.returncode == 0, own_test.stdout[-3000:]
    assert "4 passed" in own_test.stdout


def test_init_refuses_a_bad_name_and_a_folder_in_use(tmp_path):
    bad = run(sys.executable, "-m", "envhub.cli", "init", "Acme-Envs", "--dir", str(tmp_path))
    assert bad.returncode == 2 and "lower-case letters" in bad.stderr
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "notes.txt").write_text("mine")
    taken = run(sys.executable, "-m", "envhub.cli", "init", "acme", "--dir", str(tmp_path))
    assert taken.returncode == 2 and "already exists and is not empty" in taken.stderr
    assert (tmp_path / "acme" / "notes.txt").read_text() == "mine"
