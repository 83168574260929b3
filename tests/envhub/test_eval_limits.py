"""``envhub eval`` at its limits: an episode that runs out of time (whose side held it), a reply
too large to keep whole in ``--out``, two runs at once into one ``--out``, a resume interrupted
as it reads the folder, and a folder on a filesystem without locks. Each test is what a user
would see: the summary's figures, the ``note:`` lines, the record, the exit code."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openai", reason="needs the openai extra: pip install -e '.[openai]'")
pytest.importorskip("fastapi", reason="needs the server extra: pip install -e '.[server]'")

import openai
from fastapi import FastAPI

import envhub
from envhub.core import TextSpace
from envhub.eval_output import LOCK_FILE
from envhub.eval_records import RECORD_TEXT_CHARS, read_episodes
from envhub.evaluation import evaluate
from tests.envhub.eval_cli_helpers import eval_cli, summary_rows
from tests.envhub.openai_servers import completion, scripted_server, serve_app
from tests.helpers import CountdownEnv

COUNTDOWN = "evallimits/countdown-v0"
"""Say 'go' to win."""
RELEASE = threading.Event()
"""Set at the end of each test: lets hung envs and stalled replies return."""
STARTED = threading.Event()
"""Set by the first step of ``PAUSED`` (which then waits for ``RELEASE``)."""


class Hangs(CountdownEnv):
    """``step`` does not return until the test sets ``RELEASE``."""

    def on_step(self, action: str) -> Any:
        RELEASE.wait()
        return super().on_step(action)


class Paused(CountdownEnv):
    """Its first step (of any instance) sets ``STARTED`` and waits for ``RELEASE``."""

    def on_step(self, action: str) -> Any:
        if not STARTED.is_set():
            STARTED.set()
            RELEASE.wait()
        return super().on_step(action)


class LongWinded(CountdownEnv):
    """Won by a reply of any length that ends with 'go'; its info says how long it was."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # (TextEnv's action space refuses 100k characters and more)
        self.action_space = TextSpace(10 * RECORD_TEXT_CHARS, sampler=self.sample_action)

    def on_step(self, action: str) -> Any:
        info = {"chars": len(action)}
        return envhub.Turn("Done.", terminated=True, success=action.endswith("go"), info=info)


class Forks(CountdownEnv):
    """Forks a helper process on reset (as ``envhub.adapters.answer_guard`` does) that lives on
    after the run, until the test closes the write end of ``HELPER_PIPE``."""

    def on_reset(self, options: dict[str, Any]) -> Any:
        read, write = HELPER_PIPE
        pid = os.fork()
        if pid == 0:
            os.close(write)
            os.read(read, 1)  # (returns once the test closes its write end)
            os._exit(0)
        HELPERS.append(pid)
        return super().on_reset(options)


WAIT_ON_FD = "import os, sys; os.read(int(sys.argv[1]), 1)"


class SharesTheLock(CountdownEnv):
    """On reset, starts a process that holds a copy of every open file of this process's on
    ``.eval.lock`` (what a child an env forks holds until it closes them) and lives on after
    the run, until the test closes the write end of ``HELPER_PIPE``."""

    def on_reset(self, options: dict[str, Any]) -> Any:
        fds = [
            int(fd)
            for fd in os.listdir("/proc/self/fd")
            if os.path.realpath(f"/proc/self/fd/{fd}").endswith(LOCK_FILE)
        ]
        child = subprocess.Popen(
            [sys.executable, "-c", WAIT_ON_FD, str(HELPER_PIPE[0])],
            pass_fds=[*fds, HELPER_PIPE[0]],
        )
        HOLDERS.append(child)
        return super().on_reset(options)


HELPER_PIPE: tuple[int, int] = (-1, -1)
HELPERS: list[int] = []
HOLDERS: list[subprocess.Popen[bytes]] = []
HANGS, PAUSED, LONG = "evallimits/hangs-v0", "evallimits/paused-v0", "evallimits/long-v0"
FORKS, SHARES = "evallimits/forks-v0", "evallimits/shares-v0"
ENVS = {COUNTDOWN: CountdownEnv, HANGS: Hangs, PAUSED: Paused, LONG: LongWinded}
ENVS |= {FORKS: Forks, SHARES: SharesTheLock}
for _id, _entry in ENVS.items():
    envhub.register(_id, _entry, max_turns=3)


@pytest.fixture(autouse=True)
def release_what_waits() -> Iterator[None]:
    RELEASE.clear()
    STARTED.clear()
    yield
    RELEASE.set()


@contextlib.contextmanager
def stalling_server(stalls: Callable[[int], bool]) -> Iterator[str]:
    """An OpenAI-compatible server whose ``n``-th chat request (from 0) gets no answer until
    the test ends where ``stalls(n)``, and 'go' otherwise (a plain ``def`` handler: FastAPI
    runs each in a thread of its own, so the other requests are answered meanwhile)."""
    app = FastAPI()
    count = {"n": 0}
    lock = threading.Lock()

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    @app.post("/v1/chat/completions")
    def chat() -> dict[str, Any]:
        with lock:
            n, count["n"] = count["n"], count["n"] + 1
        if stalls(n):
            RELEASE.wait()
        return completion("go")

    with serve_app(app) as url:
        try:
            yield f"{url}/v1"
        finally:
            RELEASE.set()


# ------------------------------------------------------------------- an episode out of time
@pytest.mark.timeout(60)
def test_a_model_that_stalls_past_the_episode_timeout_is_measured_and_a_note_says_why(
    tmp_path: Path,
) -> None:
    with stalling_server(lambda n: n == 0) as url:
        result = eval_cli(
            COUNTDOWN, "--model", url, "--episodes", "2", "--concurrency", "1",
            "--episode-timeout", "2", "--retries", "0", "--out", str(tmp_path), "--json",
        )  # fmt: skip
    assert result.exit_code == 0, result.output
    row = summary_rows(tmp_path)[COUNTDOWN]
    assert row["failures"] == {"episode_timeout": 1}
    assert row["success_rate"] == 0.5
    assert row["measured"] == 2 and row["measured_success_rate"] == 0.5  # not left out
    [note] = [line for line in result.stderr.splitlines() if "episode_timeout" in line]
    assert note.startswith("note:") and COUNTDOWN in note
    assert "cannot tell" in note and "--timeout" in note
    [stalled] = [e for e in read_episodes(tmp_path / "episodes.jsonl") if e.failure]
    assert "the agent's turns" in stalled.detail, stalled.detail


@pytest.mark.timeout(60)
def test_an_env_that_hangs_past_the_episode_timeout_is_an_env_failure_and_resume_replays_it(
    tmp_path: Path,
) -> None:
    args = [HANGS, COUNTDOWN, "--agent", "random", "--episodes", "2", "--out", str(tmp_path)]
    result = eval_cli(*args, "--episode-timeout", "0.5")
    assert result.exit_code == 1, result.output  # a row that measured nothing
    rows = summary_rows(tmp_path)
    assert rows[HANGS]["failures"] == {"env_timeout": 2} and rows[HANGS]["measured"] == 0
    assert rows[COUNTDOWN]["failures"] == {}
    assert HANGS in result.stderr and "--episode-timeout" in result.stderr
    hung = [e for e in read_episodes(tmp_path / "episodes.jsonl") if e.failure]
    assert all("the env's calls" in e.detail for e in hung), [e.detail for e in hung]
    RELEASE.set()  # the env is fixed
    again = eval_cli(*args, "--episode-timeout", "0.5", "--resume")
    assert again.exit_code == 0, again.output
    assert summary_rows(tmp_path)[HANGS]["failures"] == {}


# ------------------------------------------------------------------ a reply too large to keep
@pytest.mark.timeout(60)
def test_a_huge_reply_is_cut_in_the_record_but_the_env_scores_all_of_it(tmp_path: Path) -> None:
    size = RECORD_TEXT_CHARS + 1_000_000
    huge = "x" * (size - 2) + "go"
    with scripted_server(lambda body: completion(huge)) as server:
        client = openai.OpenAI(base_url=server.url, api_key="test", max_retries=0, timeout=30)
        [summary] = evaluate([LONG], client=client, episodes=1, out=tmp_path)
    assert summary.success_rate == 1.0  # the env saw the 'go' past the cut
    assert (tmp_path / "episodes.jsonl").stat().st_size < 2 * RECORD_TEXT_CHARS
    [episode] = read_episodes(tmp_path / "episodes.jsonl")
    assert episode.info["chars"] == size
    [reply] = [m for m in episode.messages if m["role"] == "assistant"]
    text = reply["content"]
    kept = text[: text.index("…[cut: ")]
    assert len(text) <= RECORD_TEXT_CHARS and set(kept) == {"x"}
    assert text.endswith(f"…[cut: {size - len(kept)} chars]")


# -------------------------------------------------------------------- two runs, one --out
@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", ["--resume", "--overwrite"])
def test_a_second_run_into_an_out_in_use_fails_at_once_and_leaves_the_first_whole(
    tmp_path: Path, flag: str
) -> None:
    args = ["--agent", "random", "--episodes", "2", "--out", str(tmp_path)]
    finished: list[Any] = []
    first = threading.Thread(
        target=lambda: finished.append(evaluate([PAUSED], ["random"], episodes=2, out=tmp_path))
    )
    first.start()
    try:
        assert STARTED.wait(30), "the first run did not start"
        second = eval_cli(PAUSED, *args, flag)
    finally:
        RELEASE.set()
        first.join(30)
    assert second.exit_code == 2, second.output
    message = " ".join(second.stderr.split())
    assert str(tmp_path) in message and "another envhub eval" in message
    assert "wait for it to end" in message and "another --out" in message
    assert finished and finished[0][0].episodes == 2  # the first run, untouched
    assert len(read_episodes(tmp_path / "episodes.jsonl")) == 2
    assert summary_rows(tmp_path)[PAUSED]["episodes"] == 2
    again = eval_cli(PAUSED, *args, "--resume")  # once it has ended, the folder is free
    assert again.exit_code == 0, again.output


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env_id", [FORKS, SHARES], ids=["forked helper", "a copy of the file"])
def test_a_process_an_env_started_does_not_keep_the_out_locked_after_the_run(
    tmp_path: Path, env_id: str
) -> None:
    """A child an env forks shares the run's open files until it closes them, and may outlive
    the run (``answer_guard``'s helper does): the folder is the run's, not the child's."""
    global HELPER_PIPE
    HELPER_PIPE = os.pipe()
    args = [env_id, "--agent", "random", "--episodes", "1", "--out", str(tmp_path)]
    try:
        first = eval_cli(*args)
        assert first.exit_code == 0, first.output
        assert HELPERS or (HOLDERS and HOLDERS[0].poll() is None), "no other process runs"
        again = eval_cli(*args, "--overwrite")  # the other process still runs
        assert again.exit_code == 0, again.output
    finally:
        os.close(HELPER_PIPE[1])
        os.close(HELPER_PIPE[0])
        for pid in HELPERS:
            os.waitpid(pid, 0)
        for child in HOLDERS:
            child.wait(30)
        HELPERS.clear()
        HOLDERS.clear()


@pytest.mark.timeout(60)
def test_a_resume_interrupted_while_it_reads_the_episodes_leaves_the_out_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while ``--resume`` reads a large ``episodes.jsonl`` (in a notebook, say): the
    next run into the folder in that process is not refused as if another run held it."""
    evaluate([COUNTDOWN], ["random"], episodes=2, out=tmp_path)

    def interrupted(path: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr("envhub.evaluation.read_episodes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        evaluate([COUNTDOWN], ["random"], episodes=2, out=tmp_path, resume=True)
    monkeypatch.undo()
    [summary] = evaluate([COUNTDOWN], ["random"], episodes=3, out=tmp_path, resume=True)
    assert summary.episodes == 3


def lock_handles(out: Path) -> list[str]:
    """This process's open files that are ``out``'s lock file."""
    fds = Path("/proc/self/fd")
    found = []
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(fd) == str(out / ".eval.lock"):
                found.append(fd.name)
    return found


@pytest.mark.timeout(60)
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts open files in /proc")
@pytest.mark.parametrize("code", ["ENOLCK", "EOPNOTSUPP", "ENOSYS"])
def test_an_out_on_a_filesystem_without_locks_is_played_into_unlocked_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, code: str
) -> None:
    """NFS without lockd, some FUSE or SMB mounts: ``lockf`` fails with an error other than
    'held'. The run goes on, a warning says the folder is not protected from another process's
    run, and the lock file is not left open."""
    import errno
    import fcntl
    import logging

    def no_locks(file: Any, operation: int, *args: Any) -> None:
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    with caplog.at_level(logging.WARNING):
        [summary] = evaluate([COUNTDOWN], ["random"], episodes=2, out=tmp_path)
    assert summary.episodes == 2 and len(read_episodes(tmp_path / "episodes.jsonl")) == 2
    [warning] = [r.getMessage() for r in caplog.records if ".eval.lock" in r.getMessage()]
    assert str(tmp_path) in warning and "not prevented" in warning, warning
    assert lock_handles(tmp_path) == []
