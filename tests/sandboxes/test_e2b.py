"""The e2b adapter against a local fake of the E2B HTTP APIs (the cloud is unreachable here),
plus one live test that runs only with E2B_API_KEY."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("e2b_code_interpreter", reason="E2B SDK missing: pip install 'envhub[e2b]'")

from sandboxes import Limits, SandboxFileError, SandboxUnavailableError, make_sandbox
from tests.sandboxes.fake_e2b import FakeE2B


@pytest.fixture
def fake():
    with FakeE2B() as server:
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
