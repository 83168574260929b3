"""A local OpenEnv server (``openenv/local-v0``) follows its env: started again when it died,
named (not base_url) when it cannot be, and gone with its owner even on SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

pytest.importorskip("openenv", reason="needs the openenv extra: pip install 'envhub[openenv]'")
psutil = pytest.importorskip("psutil")

import envhub
from envhub.errors import SourceConnectionError

APP = "tests.envhub.adapters.openenv_apps:app"


def _kill_server(env) -> None:
    process = env.unwrapped._server._process
    process.kill()
    process.wait()


@pytest.mark.timeout(120)
def test_a_local_server_that_died_is_started_again_at_the_next_reset():
    env = envhub.make("openenv/local-v0", app=APP)
    try:
        env.reset(seed=0)
        _kill_server(env)
        messages, _ = env.reset(seed=1)
        assert "Guess my number" in messages[-1]["content"]
        assert env.step("5")[0]  # the new server plays the episode
    finally:
        env.close()


@pytest.mark.timeout(120)
def test_a_local_server_that_cannot_be_started_again_is_named_not_base_url():
    env = envhub.make("openenv/local-v0", app=APP)
    try:
        env.reset(seed=0)
        _kill_server(env)
        env.unwrapped.app = "tests.envhub.adapters.no_such_module:app"
        with pytest.raises(SourceConnectionError) as raised:
            env.reset(seed=1)
        message = str(raised.value)
        assert "no_such_module:app" in message and "base_url" not in message
    finally:
        env.close()


OWNER = f"""
import envhub
env = envhub.make("openenv/local-v0", app={APP!r})
env.reset(seed=0)
print(env.unwrapped._server._process.pid, flush=True)
input()  # until the test kills us
"""


@pytest.mark.timeout(120)
def test_a_local_server_dies_with_its_owner_even_on_sigkill():
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        server = psutil.Process(int(owner.stdout.readline()))
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        try:
            server.wait(timeout=30)
        except psutil.TimeoutExpired:
            server.kill()
            pytest.fail("the local OpenEnv server outlived its SIGKILLed owner by 30 s")
    finally:
        owner.kill()
        owner.wait()
        owner.stdin.close()
        owner.stdout.close()


@pytest.mark.timeout(120)
def test_a_local_server_started_in_a_call_thread_outlives_that_thread():
    """The trainer runs each env call in a thread of its own: the server a reset started in
    one must live on after it (PR_SET_PDEATHSIG, which follows the thread, would end it)."""
    env = envhub.make("openenv/local-v0", app=APP)
    try:
        call = threading.Thread(target=env.reset, kwargs={"seed": 0})
        call.start()
        call.join()
        server = psutil.Process(env.unwrapped._server._process.pid)
        assert env.step("5")[0] and server.is_running()
    finally:
        env.close()
