"""The e2b adapter against a local fake of the E2B HTTP APIs (the cloud is unreachable here),
plus one live test that runs only with E2B_API_KEY."""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("e2b_code_interpreter", reason="E2B SDK missing: pip install 'envhub[e2b]'")

from sandboxes import (
    Limits,
    SandboxError,
    SandboxFileError,
    SandboxPool,
    SandboxUnavailableError,
    SessionError,
    make_sandbox,
)
from sandboxes import e2b as e2b_backend
from tests.sandboxes.fake_e2b import FakeE2B


@pytest.fixture
def fake(monkeypatch):
    """The fake E2B, sharing its clock with the adapter: ``fake.advance(s)`` moves both, so a
    test sees VMs expire without waiting for them."""
    try:
        server = FakeE2B()
    except RuntimeError as e:  # no bubblewrap: the fake will not run commands unconfined
        pytest.skip(str(e))
    monkeypatch.setattr(e2b_backend, "_now", server.now)
    with server:
        yield server


@pytest.fixture
def sb(fake):
    sandbox = make_sandbox(
        "e2b", limits=Limits(wall_time_s=5, max_output_bytes=20_000), **fake.options
    )
    with sandbox:
        yield sandbox


def test_create_request_carries_key_template_and_network_off(fake, sb):
    (request,) = fake.created
    assert request["allow_internet_access"] is False
    assert request["metadata"] == {"envhub.sandbox": sb.id}
    assert request["timeout"] == 600 and request["templateID"] == "code-interpreter-v1"
    method, path, headers, _ = fake.requests[0]
    assert (method, path, headers["x-api-key"]) == ("POST", "/v2/sandboxes", "e2b_test_key")


def test_run_sends_a_quoted_command_with_limits_cwd_and_only_the_given_env(fake, sb, monkeypatch):
    monkeypatch.setenv("ENVHUB_HOST_SECRET", "s3cr3t")
    r = sb.run(["echo", "two words", "$HOME"], env={"GIVEN": "1"})
    assert r.ok and r.stdout == "two words $HOME\n", r
    started = fake.started[-1]
    assert started["cmd"] == "/bin/bash" and started["cwd"] == "/home/user"
    assert (
        "ulimit -t 10" in started["args"][-1]
        and "exec echo 'two words' '$HOME'" in started["args"][-1]
    )
    assert started["envs"]["GIVEN"] == "1" and "ENVHUB_HOST_SECRET" not in started["envs"]
    rpc = [h for m, p, h, _ in fake.requests if p == "/process.Process/Start"][-1]
    assert rpc["x-access-token"] == "envd-token" and rpc["e2b-sandbox-id"].startswith("fake")


def test_exit_code_stderr_and_stdin(sb):
    r = sb.run("echo oops >&2; exit 3")
    assert (r.exit_code, r.stderr, r.ok) == (3, "oops\n", False)
    assert sb.run("cat", stdin="fed").stdout == "fed"
    assert sb.run_code("print(6 * 7)").stdout == "42\n"


def test_timeout_kills_the_remote_process(fake, sb):
    r = sb.run("sleep 30", timeout=1)
    assert r.timed_out and r.exit_code == 137 and r.wall_time_s < 10, r
    assert fake.signals and fake.signals[-1][1].name == "SIGKILL"


def test_output_flood_is_cut_and_killed(fake, sb):
    r = sb.run(["python3", "-c", "while True: print('x' * 1000)"], timeout=20)
    assert r.output_truncated and len(r.stdout) <= 20_000 and r.wall_time_s < 15, r.describe()
    assert fake.signals, "the flooding process must be killed"


def test_files_round_trip_and_missing_file(sb):
    sb.write_file("dir/data.txt", "hello")
    assert sb.read_file("dir/data.txt") == "hello"
    assert sb.run("cat dir/data.txt").stdout == "hello"
    with pytest.raises(SandboxFileError, match="missing.txt"):
        sb.read_file("missing.txt")


def test_python_session_keeps_state(sb):
    with sb.session("python") as py:
        assert py.run("x = 20").ok
        assert py.run("print(x + 1)").stdout == "21\n"
        r = py.run("1 / 0")
        assert r.exit_code == 1 and "ZeroDivisionError" in r.stderr


def test_stop_kills_the_remote_sandbox(fake):
    sandbox = make_sandbox("e2b", **fake.options).start()
    remote_id = sandbox.remote.sandbox_id
    assert fake.killed == []
    sandbox.stop()
    sandbox.stop()
    assert fake.killed == [remote_id]


def test_missing_or_wrong_key_is_a_clear_error(fake, monkeypatch):
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    options = {k: v for k, v in fake.options.items() if k != "api_key"}
    with pytest.raises(SandboxUnavailableError, match="set E2B_API_KEY"):
        make_sandbox("e2b", **options).start()
    with pytest.raises(SandboxUnavailableError, match="Invalid API key|401"):
        make_sandbox("e2b", api_key="wrong", **options).start()


def test_reset_kills_background_processes(fake, sb):
    spy = (
        "(while :; do cat /home/user/secret.txt >> /tmp/loot 2>/dev/null; sleep 0.1; done)"
        " >/dev/null 2>&1 & echo started"
    )
    assert sb.run(["sh", "-c", spy]).stdout == "started\n"
    first_vm = sb.remote.sandbox_id
    assert fake.running(first_vm), "the spy must be running before the reset"
    sb.reset()
    # Both hold as soon as reset() returns, so no waiting: nothing of user A runs any more,
    # and B's file lives where no process of A's VM could ever read it.
    assert fake.running(first_vm) == [], "user A's process survived the reset"
    sb.write_file("secret.txt", "B's private answer")
    assert sb.remote.sandbox_id != first_vm
    assert not any(b"private" in data for data in fake.files(first_vm).values())
    assert "/home/user/secret.txt" in fake.files(sb.remote.sandbox_id)


def test_reset_leaves_no_files_anywhere(sb):
    plant = (
        "mkdir -p locked && echo a > locked/f && chmod 000 locked && echo b > /tmp/t"
        " && echo c > /var/tmp/v && echo d > /dev/shm/s && echo e > .profile_a"
    )
    assert sb.run(plant).ok
    sb.reset()
    r = sb.run("ls -A /home/user /tmp /var/tmp /dev/shm")
    assert r.ok and not any(n in r.stdout for n in ("locked", "t\n", "v\n", "s\n", "profile_a"))


def test_idle_pooled_sandbox_past_its_lifetime_is_replaced_not_handed_out_dead(fake):
    with SandboxPool("e2b", size=1, lifetime_s=600, **fake.options) as pool:
        (idle_vm,) = fake.alive
        fake.advance(601)  # idle in the pool longer than E2B's timer: the VM is gone
        assert fake.alive == []
        with pool.acquire(timeout=30) as sandbox:
            assert sandbox.run("echo alive").stdout == "alive\n"
            assert sandbox.remote.sandbox_id != idle_vm and len(fake.created) == 2


def test_runs_keep_a_busy_sandbox_alive(fake):
    with make_sandbox("e2b", lifetime_s=600, **fake.options) as sandbox:
        sandbox.write_file("state.txt", "kept")
        for _ in range(3):  # 1200 s in all: E2B's 600 s timer would fire without extensions
            fake.advance(400)
            assert sandbox.run("cat state.txt").stdout == "kept"
        assert len(fake.created) == 1 and len(fake.timeouts) == 3


def test_used_sandbox_past_its_lifetime_fails_clearly(fake):
    with make_sandbox("e2b", lifetime_s=600, **fake.options) as sandbox:
        sandbox.write_file("state.txt", "lost")
        fake.advance(601)
        with pytest.raises(SandboxError, match="lifetime_s=600"):
            sandbox.run("cat state.txt")


def test_session_timeout_restarts_the_kernel(sb):
    with sb.session("python") as py:
        assert py.run("x = 1").ok
        hung = py.run("import time\nwhile True:\n    time.sleep(0.05)\n    print('.')", timeout=1)
        assert hung.timed_out and py.restarts == 1, hung
        after = py.run("print('next')", timeout=3)
        assert after.ok and after.stdout == "next\n", after
        assert "NameError" in py.run("print(x)").stderr, "state is lost with the restart"


def test_session_output_flood_is_cut_and_stopped(sb):
    with sb.session("python") as py:
        t0 = time.monotonic()
        r = py.run("while True:\n    print('x' * 1000)", timeout=20)
        assert r.output_truncated and len(r.stdout) <= 20_000, r.describe()
        assert time.monotonic() - t0 < 10 and py.restarts == 1
        assert py.run("print('next')", timeout=3).stdout == "next\n"


def test_session_sdk_failures_are_session_errors(fake, sb):
    with sb.session("python") as py:
        fake.boxes[sb.remote.sandbox_id].kill()  # the VM dies under the session
        with pytest.raises(SessionError, match="python session"):
            py.run("print(1)")


def test_create_failing_after_the_vm_exists_kills_it(fake):
    fake.break_create_response = True
    with pytest.raises(SandboxUnavailableError, match="could not create"):
        make_sandbox("e2b", **fake.options).start()
    assert len(fake.created) == 1 and fake.alive == []


@pytest.mark.e2b
@pytest.mark.skipif(
    not os.environ.get("E2B_API_KEY"), reason="live E2B test: set E2B_API_KEY to run it"
)
def test_e2b_live_basics():
    """The live path (untested on the project's machines, which cannot reach E2B)."""
    with make_sandbox("e2b", limits=Limits(wall_time_s=20)) as live:
        assert live.run(["python3", "-c", "print(1)"]).stdout == "1\n"
        assert live.run("while :; do :; done", timeout=3).timed_out
        r = live.run(
            [
                "python3",
                "-c",
                "import socket; socket.create_connection(('192.0.2.1', 80), timeout=3)",
            ]
        )
        assert not r.ok
