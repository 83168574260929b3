"""GEM envs as envhub envs: games, dataset envs (math, QA, code), tools, errors."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("gem", reason="needs the gem extra: pip install 'envhub[gem]'")

import envhub
from envhub.errors import SourceConfigError
from tests.envhub.adapters.sweep import failing

SAMPLE = [
    "gem/game.GuessTheNumber-easy-v0",
    "gem/game.Mastermind-easy-v0",
    "gem/game.Minesweeper-easy-v0",
    "gem/game.TowerofHanoi-easy-v0",
    "gem/game.Game2048-easy-v0",
    "gem/game.Sudoku-easy-v0",
]

GAMES_NOT_OFFLINE = {
    # NLTK corpora, downloaded at first use
    "game:Hangman-v0-easy",
    "game:Hangman-v0-hard",
    "game:Hangman-v0-random",
    "game:WordSearch-v0-easy",
    "game:WordSearch-v0-hard",
    "game:WordSearch-v0-random",
    "game:Wordle-v0-easy",
    "game:Wordle-v0-hard",
    "game:Wordle-v0-random",
    # the -random variant passes None where the game needs a number
    "game:Crosswords-v0-random",
    "game:FifteenPuzzle-v0-random",
}
"""GEM 0.1.0 games that cannot pass here, and why (see the README)."""

TOO_SLOW_FOR_ONE_RUN = {"game:Sokoban-v0-hard", "game:Sokoban-v0-random"}

MATH = [{"problem": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(1, 2), (3, 4)]]
QA = [{"problem": "Capital of France?", "answer": ["Paris"]}, {"problem": "2+2?", "answer": ["4"]}]
CODE = [
    {
        "problem": "Read n and print 2n.",
        "tests": {"inputs": ["3\n", "5\n"], "outputs": ["6\n", "10\n"]},
    }
]


@pytest.mark.parametrize("env_id", SAMPLE)
def test_sample_games_keep_the_contract(env_id):
    envhub.check_env(envhub.make(env_id), factory=lambda: envhub.make(env_id))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_games_that_load_offline_pass():
    games = [s for s in envhub.list_envs("gem") if s.kwargs["env"].startswith("game:")]
    swept = [s for s in games if s.kwargs["env"] not in TOO_SLOW_FOR_ONE_RUN]
    failed = failing(swept, lambda spec: spec.kwargs["env"])
    assert set(failed) == GAMES_NOT_OFFLINE, failed
    assert len(games) == 37


@pytest.mark.parametrize(
    ("env_id", "rows", "right"),
    [
        ("gem/math.GSM8K-v0", MATH, "So the answer is \\boxed{{{answer}}}."),
        ("gem/qa.NaturalQuestions-v0", QA, "<answer>{answer}</answer>"),
    ],
)
def test_dataset_envs_play_a_users_dataset(tmp_path, env_id, rows, right):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    if env_id.startswith("gem/math"):  # GEM 0.1.0's QA env crashes on a reply with no answer
        envhub.check_env(
            envhub.make(env_id, dataset=str(path)),
            factory=lambda: envhub.make(env_id, dataset=str(path)),
        )
    env = envhub.make(env_id, dataset=str(path))
    messages, _ = env.reset(seed=0)
    row = next(r for r in rows if r["problem"] in messages[-1]["content"])
    answer = row["answer"][0] if isinstance(row["answer"], list) else row["answer"]
    _, reward, terminated, _, info = env.step(right.format(answer=answer))
    assert (reward, terminated, info["success"]) == (1.0, True, True)


def test_code_solutions_are_graded_in_an_envhub_sandbox():
    env = envhub.make("gem/code.CodeContest-v0", dataset=CODE)
    env.reset(seed=0)
    solution = "```python\nn = int(input())\nprint(2 * n)\n```"
    assert env.step(solution)[1] == 1.0
    env.reset(seed=0)
    escape = "```python\nimport socket\nsocket.create_connection(('1.1.1.1', 53), 2)\nprint(6)\n```"
    assert env.step(escape)[1] == 0.0  # no network in the sandbox: it fails the tests


def test_gems_python_tool_is_an_envhub_tool_schema():
    env = envhub.make("gem/math.GSM8K-v0", dataset=MATH, tools=["python"])
    messages, info = env.reset(seed=0)
    assert [tool["function"]["name"] for tool in info["tools"]] == ["python"]
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    messages, _, terminated, _, _ = env.step(call)
    (answer,) = messages
    assert answer["role"] == "tool" and answer["tool_call_id"] == "call_0"
    assert "Code execution result: 42" in answer["content"] and not terminated
    bad = '<tool_call>{"name": "python", "arguments": {"script": "1"}}</tool_call>'
    _, _, _, _, info = env.step(bad)
    assert info["invalid_action"]
    native = env.step("<python>print(1 + 1)</python>")[0][0]  # GEM's own form still works
    assert native["role"] == "user" and "Code execution result: 2" in native["content"]
    env.close()
    with pytest.raises(SourceConfigError, match="is not mapped.*maps: python"):
        envhub.make("gem/math.GSM8K-v0", dataset=MATH, tools=["search"])


def test_a_dataset_env_without_a_dataset_says_how_to_give_one():
    with pytest.raises(SourceConfigError, match=r"dataset=PATH.jsonl.*\['problem', 'answer'\]"):
        envhub.make("gem/math.GSM8K-v0")
    with pytest.raises(SourceConfigError, match="takes no dataset"):
        envhub.make("gem/game.Sudoku-easy-v0", dataset=MATH)
    with pytest.raises(SourceConfigError, match="Did you mean 'game:Sudoku-v0-easy'"):
        envhub.make("gem/game.Sudoku-easy-v0", env="game:Sudoku-v0-eazy")
