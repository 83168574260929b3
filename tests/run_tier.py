"""``make test``: the default tier as two pytest processes at once.

Most of the suite waits: on sandbox deadlines, subprocesses, servers, Docker, browsers, Ray and
vLLM start-up (``tests/sandboxes`` and ``tests/envhub/server`` use about a third of a core over
their wall time). One pytest process leaves a 2-core machine idle for much of its run, so the
CPU-bound tests in ``BESIDE`` (the trainer's algorithms, strategies, rollout machinery,
workers and weight syncs on fake engines and tiny models, in-process training runs, the game
envs) run in a second process beside the rest. They touch nothing the others look at: no
sandbox, Docker, browser, MCP server or multi-node Ray cluster, and no scan of the host's
processes (a local Ray is each process's own; ports are free ones). The few tests that watch
state every process shares (``ALONE``) run by themselves after both.

Every process gets the same pytest arguments; the first streams its output, the others' follow.
The exit code is the first failing one, and a process that ran no test (pytest's 5) fails. With
paths, ``-k`` or another selection among the arguments, one pytest runs exactly as asked.

    python tests/run_tier.py [PYTEST_ARGS...]
"""

from __future__ import annotations

import glob
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BESIDE = (
    "tests/trainer/algos",
    "tests/trainer/strategies",
    "tests/trainer/rollout",
    "tests/trainer/weights/test_[bps]*.py",
    "tests/trainer/workers",
    "tests/envs/games",
    "tests/trainer/test_config*.py",
    "tests/trainer/test_checkpoint*.py",
    "tests/trainer/test_env_mix.py",
    "tests/trainer/test_learning.py",
    "tests/trainer/test_lora.py",
    "tests/trainer/test_memory*.py",
    "tests/trainer/test_metrics*.py",
    "tests/trainer/test_model*.py",
    "tests/trainer/test_sft*.py",
    "tests/trainer/test_warm_start*.py",
)
"""What runs in the second process (directories, files, globs from the repository root)."""
ALONE = ("tests/trainer/weights/test_transport.py",)
"""What runs after both, alone: tests that watch state every process shares (a segment a killed
trainer left in /dev/shm, which any process that makes one collects)."""
SELECTING = ("-k", "--lf", "--last-failed", "--ff", "--sw", "--stepwise", "--deselect")
"""Arguments that choose tests: with one of them, the tier runs as one pytest."""


def _chooses_tests(args: list[str]) -> bool:
    """Whether ``args`` name paths or select tests (then pytest runs them as given)."""
    for index, arg in enumerate(args):
        if arg.split("=")[0] in SELECTING:
            return True
        follows_option = index > 0 and args[index - 1] in ("-m", "-p", "-c", "-o", "--rootdir")
        if not arg.startswith("-") and not follows_option:
            return True  # a path or node id
    return False


def _paths(patterns: tuple[str, ...]) -> list[str]:
    paths = [match for pattern in patterns for match in sorted(glob.glob(str(ROOT / pattern)))]
    return [str(Path(path).relative_to(ROOT)) for path in paths]


def _beside() -> list[str]:
    return _paths(BESIDE)


def _status(code: int, which: str) -> int:
    if code == 5:
        print(f"pytest ({which}) collected no tests: failing on purpose", flush=True)
        return 1
    return code


def main(args: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest"]
    beside = _beside()
    if _chooses_tests(args) or not beside:
        return _status(subprocess.call([*pytest, *args], cwd=ROOT), "as asked")
    with tempfile.TemporaryFile("w+") as log:
        second = subprocess.Popen(
            [*pytest, *args, *beside], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
        )
        alone = _paths(ALONE)
        try:
            ignored = [f"--ignore={path}" for path in [*beside, *alone]]
            first = subprocess.call([*pytest, *args, *ignored], cwd=ROOT)
        except BaseException:  # Ctrl-C: the second goes too
            second.kill()
            second.wait()
            raise
        second_code = second.wait()
        log.seek(0)
        print(f"\n===== the tests run beside the rest ({', '.join(BESIDE)}) =====", flush=True)
        sys.stdout.write(log.read())
        sys.stdout.flush()
    print(f"\n===== the tests run alone ({', '.join(ALONE)}) =====", flush=True)
    last = subprocess.call([*pytest, *args, *alone], cwd=ROOT) if alone else 0
    return _status(first, "the rest") or _status(second_code, "beside") or _status(last, "alone")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
