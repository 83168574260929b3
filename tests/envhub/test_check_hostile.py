"""`envhub check` (and `envhub init`) against envs and input that fight back.

Each test attacks one property a user relies on: whatever one env does (exit, hang, fail to
build, raise an error that will not pickle, put markup in its messages), that env is reported
as failed, naming what it did, every other id is still checked, and the command ends with its
summary and exit code 1. Nothing `envhub check` starts outlives it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

import envhub
from envhub.checker import check_env
from envhub.cli import main
from tests.helpers import CountdownEnv, process_alive, register_countdown

GOOD = "helpers/countdown-v0"


class Exits(CountdownEnv):
    """Calls sys.exit on a step, as some game engines do on a 'quit' command."""

    def on_step(self, action):
        sys.exit()


class BrokenConstructor(CountdownEnv):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        raise RuntimeError("cannot open data file levels.json")


class NeedsPackage(CountdownEnv):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        import hostile_missing_pkg  # noqa: F401 - not installed, on purpose


class DataError(Exception):
    """An exception whose constructor takes two arguments: it does not unpickle from its args."""

    def __init__(self, path, reason):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


class RaisesUnpicklable(CountdownEnv):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        raise DataError("/data/levels.json", "missing")


class HangsOnStep(CountdownEnv):
    def on_step(self, action):
        threading.Event().wait()  # forever


class MarkupInErrors(CountdownEnv):
    def on_step(self, action):
        raise ValueError("unknown command; try [/help] or [bold]quit[/bold]")


ENVS = {
    "hostile/exits-v0": "Exits",
    "hostile/broken-v0": "BrokenConstructor",
    "hostile/needs-v0": "NeedsPackage",
    "hostile/unpicklable-error-v0": "RaisesUnpicklable",
    "hostile/hangs-v0": "HangsOnStep",
    "hostile/markup-v0": "MarkupInErrors",
}


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_countdown()
    for env_id, name in ENVS.items():
        envhub.register(env_id, f"tests.envhub.test_check_hostile:{name}", max_turns=3)


def check(*args: str):
    return CliRunner().invoke(main, ["check", "--no-gymnasium", *args])


def block(output: str, env_id: str) -> str:
    """The (indented) lines printed under ``env_id``'s header, up to the next header."""
    lines = output.split(f"{env_id}\n", 1)[1].splitlines()
    return "\n".join(line for line in itertools.takewhile(lambda x: x.startswith(" "), lines))


def assert_only_failed(result, failed: str) -> None:
    assert result.exit_code == 1, result.output
    assert f"1 of 2 environment(s) failed: {failed}" in result.output, result.output
    assert GOOD in result.output.splitlines()  # the other id was checked, and passed
    assert "✗" not in block(result.output, GOOD)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_an_env_that_calls_sys_exit_fails_and_the_others_are_still_checked(jobs):
    result = check("hostile/exits-v0", GOOD, "-j", jobs)
    assert_only_failed(result, "hostile/exits-v0")
    assert "✗ check_step" in block(result.output, "hostile/exits-v0")
    assert "sys.exit" in result.output


def test_check_env_reports_sys_exit_as_a_failed_check():
    report = check_env(Exits(), raise_on_failure=False, gymnasium_checks=False)
    failed = {r.name: r.message for r in report.failures}
    assert "check_step" in failed and "sys.exit" in failed["check_step"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_an_env_that_cannot_be_built_fails_and_the_others_are_still_checked(jobs):
    result = check("hostile/broken-v0", GOOD, "-j", jobs)
    assert_only_failed(result, "hostile/broken-v0")
    failure = block(result.output, "hostile/broken-v0")
    assert "✗ make" in failure
    assert "RuntimeError: cannot open data file levels.json" in failure


@pytest.mark.timeout(120)
def test_a_missing_optional_package_names_the_extra_and_the_others_are_still_checked(
    monkeypatch,
):
    import envhub.extras

    monkeypatch.setitem(envhub.extras.EXTRA_FOR_MODULE, "hostile_missing_pkg", "hostile")
    result = check("hostile/needs-v0", GOOD)
    assert_only_failed(result, "hostile/needs-v0")
    failure = block(result.output, "hostile/needs-v0")
    assert "optional package 'hostile_missing_pkg'" in failure
    assert "pip install 'envhub[hostile]'" in failure


@pytest.mark.timeout(120)
def test_an_error_that_cannot_be_pickled_is_reported_as_raised_not_as_a_crash():
    result = check("hostile/unpicklable-error-v0", GOOD, "-j", "2")
    assert_only_failed(result, "hostile/unpicklable-error-v0")
    failure = block(result.output, "hostile/unpicklable-error-v0")
    assert "DataError: /data/levels.json: missing" in failure
    assert "died" not in failure


@pytest.mark.timeout(120)
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_hanging_env_is_stopped_at_the_timeout_naming_the_check(jobs):
    result = check("hostile/hangs-v0", GOOD, "--timeout", "2", "-j", jobs)
    assert_only_failed(result, "hostile/hangs-v0")
    failure = block(result.output, "hostile/hangs-v0")
    assert "✓ check_reset" in failure
    assert "✗ check_step" in failure and "did not finish within 2 s" in failure


@pytest.mark.timeout(120)
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_markup_in_an_env_error_is_printed_as_written(jobs):
    result = check("hostile/markup-v0", GOOD, "-j", jobs)
    assert_only_failed(result, "hostile/markup-v0")
    assert "try [/help] or [bold]quit[/bold]" in block(result.output, "hostile/markup-v0")


HANGING_PLUGIN = """\
import os, subprocess, threading
import envhub


class Hangs(envhub.TextEnv):
    def on_reset(self, options):
        return "Say something.", {}

    def on_step(self, action):
        child = subprocess.Popen(["sleep", "300"])
        # one write: print() makes one per piece when PYTHONUNBUFFERED is set, and the two
        # workers' pieces would interleave on the shared pipe
        os.write(1, f"hanging {os.getpid()} {child.pid}\\n".encode())
        threading.Event().wait()


def register():
    envhub.register("hang/a-v0", entry_point="hangenvs:Hangs", max_turns=3)
    envhub.register("hang/b-v0", entry_point="hangenvs:Hangs", max_turns=3)
"""


def install_plugin(site: Path, name: str, module: str, entry_points: str) -> Path:
    """A plugin as pip would leave it: ``NAME.py`` and ``NAME-0.1.dist-info`` in ``site``."""
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)
    (site / f"{name}.py").write_text(module)
    return site


def wait_for_exit(pid: int, seconds: float) -> bool:
    """Whether ``pid`` (not necessarily our child) ends within ``seconds`` (a pidfd, no polling)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([pidfd], [], [], seconds)
    finally:
        os.close(pidfd)
    return bool(readable) or not process_alive(pid)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_envhub_check_ends_its_workers_and_what_they_started(tmp_path, signum):
    site = install_plugin(
        tmp_path, "hangenvs", HANGING_PLUGIN, "[envhub.envs]\nhang = hangenvs:register\n"
    )
    command = [sys.executable, "-m", "envhub.cli", "check", "hang/a-v0", "hang/b-v0"]
    proc = subprocess.Popen(
        [*command, "--no-gymnasium", "-j", "2"],
        env={**os.environ, "PYTHONPATH": str(site)},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        started = []
        while len(started) < 4:  # both workers are inside a step, each with a child process
            line = proc.stdout.readline()
            assert line, "envhub check ended before both envs started hanging"
            if line.startswith("hanging "):
                started += [int(pid) for pid in line.split()[1:]]
        proc.send_signal(signum)  # to the main process only, as `kill PID` does
        assert proc.wait(timeout=60) != 0
        left = [pid for pid in started if not wait_for_exit(pid, 30)]
        assert not left, f"still running after envhub check ended: {left}"
    finally:
        with contextlib.suppress(ProcessLookupError):  # (the group is gone when all went well)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ---------------------------------------------------------------------------- envhub init
def test_init_where_a_file_has_the_name_says_so(tmp_path):
    (tmp_path / "acme").write_text("not a folder")
    result = CliRunner().invoke(main, ["init", "acme", "--dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert f"{tmp_path / 'acme'} is a file" in result.output


def test_init_in_a_folder_that_cannot_be_created_names_it(tmp_path):
    (tmp_path / "blocker").write_text("a file where a folder should go")
    parent = tmp_path / "blocker" / "deeper"
    result = CliRunner().invoke(main, ["init", "acme", "--dir", str(parent)])
    assert result.exit_code == 2, result.output
    assert f"cannot create {parent / 'acme'}" in result.output
