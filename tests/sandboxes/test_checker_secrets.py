"""What a checker knows stays out of the agent's reach: ``code/terminal-v0``'s check script
(which holds the expected answer) reaches its sandbox on stdin, never in a command line, an
environment or a file, so neither a watcher the agent leaves in its session nor a program of
the agent's that the check itself runs can read the answer there.

Here (not in ``tests/envs/code``) because the backends' fixtures are: the docker param uses
this directory's private dockerd (``conftest.py``) and skips with its reason where none starts.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import envhub
from sandboxes import SandboxUnavailableError
from sandboxes.dockerd import HOST_USR_RO

COMMAND_TIMEOUT_S = 10.0
"""Bounds every command and every check (each check below waits for the watcher's scan)."""

SCAN = r"""
import os, re, sys
found, looked = set(), 0
pattern = re.compile(rb"envhub-secret-[0-9a-f]+")
skip_own_session = sys.argv[1] == "session"
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        if int(pid) == os.getpid() or (skip_own_session and os.getsid(int(pid)) == os.getsid(0)):
            continue  # (our own shell's stdin is the session's command pipe: leave it alone)
    except OSError:
        continue
    looked += 1
    blobs = []
    for name in ("cmdline", "environ"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as f:
                blobs.append(f.read())
        except OSError:
            pass
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    for fd in fds:  # stdin pipes, files: reopened through /proc, never blocking
        try:
            opened = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK)
            try:
                blobs.append(os.read(opened, 1 << 16))
            finally:
                os.close(opened)
        except OSError:
            pass
    if skip_own_session:  # another uid's memory: the kernel must refuse it
        try:
            with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
                for line in maps:
                    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                    if line.split()[1].startswith("r") and hi - lo < 1 << 24:
                        try:
                            mem.seek(lo)
                            blobs.append(mem.read(hi - lo))
                        except (OSError, ValueError, OverflowError):
                            pass
        except OSError:
            pass
    for blob in blobs:
        found.update(m.decode() for m in pattern.findall(blob))
print(*sorted(found) or ["nothing"])
print(f"scanned {looked} processes", file=sys.stderr)
"""
"""The agent's probe: every process's command line, environment, open files (and, from the
session, memory) searched for the secret; prints what it found, or ``nothing``."""


def _backend(kind: str, request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    if kind == "docker":
        return "docker", {
            "image": request.getfixturevalue("docker_image"),
            "base_url": request.getfixturevalue("docker_engine"),
            "volumes": HOST_USR_RO,
        }
    from sandboxes.local import local_isolation

    try:
        local_isolation("bwrap")
    except SandboxUnavailableError as e:
        pytest.skip(f"local isolation 'bwrap' unavailable: {e}")
    return "local", {"warm_exec": kind == "local-warm"}


@pytest.fixture(
    params=[
        pytest.param("local-warm", id="local-warm"),
        pytest.param("local-oneshot", id="local-oneshot"),
        pytest.param("docker", id="docker", marks=pytest.mark.docker),
    ]
)
def terminal(request: pytest.FixtureRequest) -> Iterator[Callable[[str], Any]]:
    """``make(check)`` -> a reset terminal env whose one task is checked by ``check``."""
    backend, options = _backend(request.param, request)
    made: list[Any] = []

    def make(check: str) -> Any:
        task = {"id": "secret", "instruction": "Write the secret to answer.txt.", "files": {}}
        env = envhub.make(
            "code/terminal-v0",
            dataset=[{**task, "check": check}],
            sandbox_backend=backend,
            sandbox_options=options,
            command_timeout_s=COMMAND_TIMEOUT_S,
        )
        made.append(env)
        env.reset(seed=0)
        return env

    yield make
    for env in made:
        env.close()


def send(env: Any, command: str) -> tuple[str, float]:
    observation, reward, *_ = env.step(f"```bash\n{command}\n```")
    return observation[0]["content"], reward


def write_probe(then: str = "true") -> str:
    """A command that writes the probe to ``.probe.py``, then runs ``then``."""
    return f"cat > .probe.py <<'EOF'\n{SCAN}\nEOF\n{then}"


def test_a_watcher_in_the_agents_session_never_sees_the_answer(terminal):
    secret = f"envhub-secret-{secrets.token_hex(8)}"
    # the check waits (bounded by its timeout) until the watcher has scanned /proc once while
    # the check runs: the scan cannot miss it for being too short-lived
    env = terminal(
        "touch .check-started; until [ -e .scanned ]; do :; done; "
        f'test -f answer.txt && test "$(cat answer.txt)" = "{secret}"'
    )
    watcher = (
        "(until [ -e .check-started ]; do :; done; python3 .probe.py session > .seen 2>&1; "
        "touch .scanned) >/dev/null 2>&1 &"
    )
    _, reward = send(env, write_probe(then=watcher))
    assert reward == 0.0
    seen, reward = send(env, "cat .seen")
    assert "scanned" in seen, f"the watcher did not run while the check did: {seen}"
    assert secret not in seen and reward == 0.0, seen
    _, reward = send(env, f"printf %s {secret} > answer.txt")  # the check does run, and pass
    assert reward == 1.0


def test_a_program_the_check_runs_finds_no_answer_in_proc(terminal):
    """A check may run the agent's own program (fix-script does); that program shares the
    checker's uid, yet the answer is in no command line, environment or open file it can read."""
    secret = f"envhub-secret-{secrets.token_hex(8)}"
    env = terminal(f'test -f .probe.py && test "$(python3 .probe.py check)" = "{secret}"')
    _, reward = send(env, write_probe())  # the check after this turn runs the probe
    assert reward == 0.0
    shown, reward = send(env, "python3 .probe.py session")  # (it runs, and finds nothing)
    assert "nothing" in shown and reward == 0.0, shown
    _, reward = send(env, f"echo 'print(\"{secret}\")' > .probe.py")  # and the check passes
    assert reward == 1.0


def test_e2b_stdin_leaves_no_file_and_no_command_line_behind(monkeypatch):
    """E2B gets stdin as a file: the command opens it and deletes it before the program starts,
    so a check's script is not left in scratch for the agent's next command to read."""
    pytest.importorskip("e2b_code_interpreter", reason="E2B SDK missing: pip install 'envhub[e2b]'")
    from sandboxes import Limits, make_sandbox
    from sandboxes import e2b as e2b_backend
    from tests.sandboxes.fake_e2b import FakeE2B

    try:
        fake = FakeE2B()
    except RuntimeError as e:  # no bubblewrap: the fake will not run commands unconfined
        pytest.skip(str(e))
    monkeypatch.setattr(e2b_backend, "_now", fake.now)
    secret = f"envhub-secret-{secrets.token_hex(8)}"
    with fake, make_sandbox("e2b", limits=Limits(wall_time_s=5), **fake.options) as sb:
        result = sb.run(["bash", "-c", "cat"], stdin=secret)
        assert result.ok and result.stdout == secret, result
        files = fake.files(sb.remote.sandbox_id)
        assert not [path for path, data in files.items() if secret.encode() in data], files
        assert all(secret not in " ".join(started["args"]) for started in fake.started)
