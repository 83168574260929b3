"""GEM envs as envhub envs: games, dataset envs (math, QA, code), tools, errors."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("gem", reason="needs the gem extra: pip install 'envhub[gem]'")

import envhub
from envhub.errors import SourceConfigError
from envhub.registry import Registry
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
    assert len(games) == 35  # GEM 0.1.0 registers 37; two can never be built (the next test)


def test_gem_ids_that_gem_itself_cannot_build_are_not_listed(tmp_path, monkeypatch):
    """GEM 0.1.0 registers Crosswords-random and FifteenPuzzle-random with options its own
    games reject for every seed: `envhub list` leaves them out, and asking for one says why."""
    monkeypatch.setenv("ENVHUB_CACHE_DIR", str(tmp_path))  # the catalog as computed now
    registry = Registry()
    registry.load_plugins()
    assert "gem/game.Crosswords-easy-v0" in registry
    assert "gem/game.FifteenPuzzle-hard-v0" in registry
    assert "gem/game.Crosswords-random-v0" not in registry
    assert "gem/game.FifteenPuzzle-random-v0" not in registry
    with pytest.raises(SourceConfigError, match="gem-llm 0.1.0 bug.*FifteenPuzzle-easy-v0"):
        envhub.make("gem/game.FifteenPuzzle-easy-v0", env="game:FifteenPuzzle-v0-random")


def boxed(*values: object) -> str:
    return "\\boxed{" + " ".join(str(value) for value in values) + "}"


def _started(env_id: str):
    """The GEM env under ``env_id`` after ``reset(seed=0)``, to read its answer from."""
    env = envhub.make(env_id)
    env.reset(seed=0)
    return env.unwrapped


def sudoku_solution(game) -> list[str]:
    """Every empty cell filled from GEM's solution grid: GEM pays 1/(empty cells) for each."""
    return [
        boxed(row + 1, col + 1, game.full_grid[row][col])
        for row, cells in enumerate(game.board)
        for col, cell in enumerate(cells)
        if cell == 0
    ]


def mastermind_solution(game) -> list[str]:
    """One peg off, then the code: GEM pays (length - 1)/length, then 1/length."""
    unused = next(n for n in range(1, game.num_numbers + 1) if n not in game.game_code)
    return [boxed(unused, *game.game_code[1:]), boxed(*game.game_code)]


def guess_the_number_solution(game) -> list[str]:
    """The number itself: GEM pays 1 at the end only."""
    return [boxed(game.game_number)]


@pytest.mark.parametrize(
    ("env_id", "solution"),
    [
        ("gem/game.Sudoku-easy-v0", sudoku_solution),
        ("gem/game.Mastermind-easy-v0", mastermind_solution),
        ("gem/game.GuessTheNumber-easy-v0", guess_the_number_solution),
    ],
)
def test_a_won_game_is_a_success_however_gem_spreads_its_reward(env_id, solution):
    env = envhub.make(env_id)
    env.reset(seed=0)
    steps = [env.step(move) for move in solution(env.unwrapped._source)]
    observation, _, terminated, truncated, info = steps[-1]
    assert observation[-1]["content"].startswith("Congratulations!")
    assert (terminated, truncated, info["success"]) == (True, False, True)
    assert not any(step[4]["success"] for step in steps[:-1])
    assert sum(step[1] for step in steps) == pytest.approx(1.0)


def test_running_out_of_turns_is_no_success():
    """Sudoku with one turn wasted (a pre-filled cell) and one cell short: GEM ends it at its
    turn limit having paid (cells - 1)/cells; GuessTheNumber pays a near miss at the end."""
    moves = sudoku_solution(_started("gem/game.Sudoku-easy-v0")._source)
    env = envhub.make("gem/game.Sudoku-easy-v0", gem_kwargs={"max_turns": len(moves)})
    env.reset(seed=0)
    board = env.unwrapped._source.board
    row, col = next((r, c) for r, cells in enumerate(board) for c, cell in enumerate(cells) if cell)
    steps = [env.step(move) for move in [boxed(row + 1, col + 1, board[row][col]), *moves[:-1]]]
    observation, _, terminated, _, info = steps[-1]
    assert "maximum number of turns" in observation[-1]["content"]
    assert terminated and not info["success"]
    assert sum(step[1] for step in steps) == pytest.approx(1 - 1 / len(moves))
    env = _started("gem/game.GuessTheNumber-easy-v0")  # 4 turns for a number from 1 to 10
    wrong = [n for n in range(1, 11) if n != env._source.game_number]
    for guess in wrong[:4]:
        _, reward, terminated, _, info = env.step(boxed(guess))
    assert terminated and reward < 1 and not info["success"]


def test_a_mine_hit_after_every_safe_cell_is_no_success():
    """GEM's Minesweeper has paid 1 in all once every safe cell is revealed, but is won only
    with every mine flagged too: revealing a mine then loses the game."""
    env = envhub.make("gem/game.Minesweeper-easy-v0")
    env.reset(seed=0)
    game = env.unwrapped._source
    steps = [env.step(boxed("reveal", 2, 2))]  # the first reveal places the mines around it
    cells = [(row, col) for row in range(game.rows) for col in range(game.cols)]
    mines = [(row, col) for row, col in cells if game.grid[row][col] == -1]
    while safe := [(r, c) for r, c in cells if (r, c) not in mines and not game.revealed[r][c]]:
        steps.append(env.step(boxed("reveal", *safe[0])))
    assert sum(step[1] for step in steps) == pytest.approx(1.0)
    assert not any(step[2] for step in steps)
    observation, _, terminated, truncated, info = env.step(boxed("reveal", *mines[0]))
    assert observation[-1]["content"].startswith("Game over! You hit a mine")
    assert (terminated, truncated, info["success"]) == (True, False, False)


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
    env.reset(seed=0)
    messages, reward, terminated, _, info = env.step(right.format(answer="Berlin"))
    assert (reward, terminated, info["success"]) == (0.0, True, False)
    assert messages[-1]["content"] == "Not correct (reward 0)."


def test_code_solutions_are_graded_in_an_envhub_sandbox():
    env = envhub.make("gem/code.CodeContest-v0", dataset=CODE)
    env.reset(seed=0)
    solution = "```python\nn = int(input())\nprint(2 * n)\n```"
    _, reward, _, _, info = env.step(solution)
    assert (reward, info["success"]) == (1.0, True)
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
    assert answer["role"] == "tool" and answer["tool_call_id"] == "call00000"
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
