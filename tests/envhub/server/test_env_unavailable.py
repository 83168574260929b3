"""A served env that stops building: clients get ``env_unavailable`` naming the env's error (not
``internal``, a hub bug), ``/health`` says so, and the hub serves again once the env is fixed."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "fastapi", reason="the server extra is not installed (pip install -e '.[server]')"
)

import httpx

from envhub.registry import register
from tests.envhub.pool.hostile_envs import HOSTILE
from tests.envhub.server.badinput import hello
from tests.envhub.server.hubtools import TOKEN, ask, raw_connect, running_hub

FRAGILE = "test/fragile-v0"


def test_an_env_that_no_longer_builds_answers_env_unavailable_until_fixed(tmp_path):
    flag = tmp_path / "refuse"
    register(FRAGILE, HOSTILE.entry_point, kwargs={"refuse_while": str(flag)}, max_turns=50)
    with running_hub(envs=[FRAGILE], workers=1, worker_restarts=1, worker_retry_s=3600) as hub:
        ws = raw_connect(hub)
        hello(ws, FRAGILE)
        assert ask(ws, {"type": "reset", "seq": 1, "seed": 0})["type"] == "reset_result"
        flag.touch()  # the env no longer builds: the crashed worker's replacement fails
        assert ask(ws, {"type": "step", "seq": 2, "action": "crash"})["type"] == "episode_failed"
        refused = ask(ws, {"type": "reset", "seq": 3, "seed": 1}, timeout=60)
        assert refused["code"] == "env_unavailable", refused
        assert "refuses to build" in refused["message"] and "3600 s" in refused["message"]
        health = httpx.get(f"{hub.http}/health").json()
        assert health["status"] == "degraded"
        assert any("env_unavailable" in line for line in health["problems"]), health
        rollout = httpx.post(
            f"{hub.http}/v1/rollout",
            json={"env": FRAGILE, "seed": 0, "actions": ["x"]},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert rollout.status_code == 503 and rollout.json()["code"] == "env_unavailable"
        metrics = httpx.get(
            f"{hub.http}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
        ).text
        counts = {
            line.split('"')[1]: float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("envhub_errors_total{")
        }
        assert counts["env_unavailable"] == 2 and counts["internal"] == 0, counts

        flag.unlink()  # fixed; the operator would wait worker_retry_s: here it is cut short
        hub.hub.pools[FRAGILE].retry_after_s = 0
        assert ask(ws, {"type": "reset", "seq": 4, "seed": 2}, timeout=60)["type"] == (
            "reset_result"
        )
        assert ask(ws, {"type": "step", "seq": 5, "action": "x"})["type"] == "step_result"
        assert httpx.get(f"{hub.http}/health").json()["status"] == "ok"
