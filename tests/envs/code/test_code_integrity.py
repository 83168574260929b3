"""A submitted solution earns only what its function's return values earn: it cannot patch the
runner, forge its report, read the tests, decide equality or shadow what the tests call."""

from __future__ import annotations

import json
import math

import pytest

import envhub
from envs.code import programming

pytest.importorskip("sandboxes.local", reason="the sandboxes package is not available")

ADD = {
    "id": "add",
    "prompt": 'def scale(x):\n    return 10 * x\n\n\ndef add(a, b):\n    """Return a + b."""\n',
    "entry_point": "add",
    "tests": (
        "def check(candidate):\n"
        "    assert candidate(1, 2) == 3\n"
        "    assert abs(candidate(0.1, 0.2) - 0.3) < 1e-9\n"
        "    assert sorted(candidate([2], [1])) == [1, 2]\n"
        "    assert scale(candidate(1, 1)) == 20\n"
        "    assert True, 'filler: not a test'\n"
    ),
    "solution": "def add(a, b):\n    return a + b\n",
}

WRONG = "def add(a, b):\n    return 7\n"
EXPLOITS = {
    "patch-the-runner": "import __main__\n__main__.run = lambda *a, **k: None\n" + WRONG,
    "forge-a-report-with-the-runners-token": (
        "import __main__, json, os\n"
        "passed = {'test': 't', 'passed': True, 'error': None}\n"
        "report = {'solution_error': None, 'results': [passed] * 1000, 'output': ''}\n"
        "print(__main__.token, json.dumps(report), file=__main__.real_stdout, flush=True)\n"
        "os._exit(0)\n"
    ),
    "read-the-tests-from-the-judges-memory": (
        "import ast, os, re\n"
        "def add(a, b):  # the judge holds the tests while it calls\n"
        "    judge, seen = os.getppid(), b''\n"
        "    with open(f'/proc/{judge}/maps') as maps, open(f'/proc/{judge}/mem', 'rb') as mem:\n"
        "        for line in maps:\n"
        "            start, end = (int(x, 16) for x in line.split()[0].split('-'))\n"
        "            if 'rw' in line.split()[1] and end - start < 1 << 26:\n"
        "                try:\n"
        "                    mem.seek(start)\n"
        "                    seen += mem.read(end - start)\n"
        "                except OSError:\n"
        "                    pass\n"
        "    call = re.escape(f'candidate({a!r}, {b!r}) == '.encode())\n"
        "    found = re.search(call + rb'([0-9]+)', seen)\n"
        "    return ast.literal_eval(found.group(1).decode()) if found else 7\n"
    ),
    "read-the-hidden-tests": (
        "import ast, json, re\n"
        "spec = json.load(open('tests.json'))\n"
        "answers = {}\n"
        "for test in spec['tests']:\n"
        "    found = re.search(r'candidate\\((.*)\\) == (.*)$', test)\n"
        "    if found:\n"
        "        answers[found.group(1)] = ast.literal_eval(found.group(2))\n"
        "def add(a, b):\n"
        "    return answers.get(f'{a!r}, {b!r}', 7)\n"
    ),
    "always-equal": (
        "class Anything:\n"
        "    __eq__ = __lt__ = __le__ = __gt__ = __ge__ = lambda self, other: True\n"
        "    __sub__ = __rsub__ = __abs__ = __iter__ = lambda self, *args: self\n"
        "    __bool__ = lambda self: True\n"
        "    __next__ = lambda self: (_ for _ in ()).throw(StopIteration)\n"
        "def add(a, b):\n"
        "    return Anything()\n"
    ),
    "shadow-what-the-tests-call": (
        "def abs(x):\n    return 0\n"
        "def sorted(x):\n    return [1, 2]\n"
        "def scale(x):\n    return 20\n" + WRONG
    ),
}


@pytest.fixture(scope="module")
def env():
    env = envhub.make("code/humaneval-binary-v0", dataset=[ADD], test_timeout_s=2.0)
    yield env
    env.close()


def test_the_reference_solution_passes_and_filler_asserts_are_not_tests(env):
    _, info = env.reset(seed=0)
    assert info["num_tests"] == 4  # `assert True, ...` is not a test
    _, reward, terminated, _, info = env.step(env.unwrapped.expert_action())
    assert (reward, terminated, info["passed"]) == (1.0, True, 4)


@pytest.mark.parametrize("code", EXPLOITS.values(), ids=EXPLOITS.keys())
def test_a_solution_cannot_earn_what_its_function_does_not(env, code):
    env.reset(seed=0)
    reply, reward, terminated, _, info = env.step(f"```python\n{code}```")
    assert (reward, terminated, info["passed"]) == (0.0, False, 0), reply[0]["content"]


PLAIN = {
    "id": "plain",
    "prompt": "def f(kind):\n    pass\n",
    "entry_point": "f",
    "tests": [
        "assert f('tuple') == (1, [2, 3]) and f('list') != (1, [2, 3])",
        "assert f('set') == {frozenset({1}), (2, 'x')} and type(f('set')) is set",
        "assert f('dict') == {(1, 2): b'\\x00\\xff', None: [1.5, True]}",
        "import math\nassert math.isnan(f('nan')) and f('inf') == -math.inf",
        "assert f('big') == 7 ** 20000 and f('complex') == 1 - 2j",
        "try:\n    f('raise')\n    assert False\nexcept KeyError as e:\n    assert 'key' in str(e)",
    ],
    "solution": (
        "import math\n"
        "def f(kind):\n"
        "    values = {'tuple': (1, [2, 3]), 'list': [1, [2, 3]],\n"
        "        'set': {frozenset({1}), (2, 'x')},\n"
        "        'dict': {(1, 2): b'\\x00\\xff', None: [1.5, True]},\n"
        "        'nan': math.nan, 'inf': -math.inf, 'big': 7 ** 20000, 'complex': 1 - 2j}\n"
        "    if kind == 'raise':\n"
        "        raise KeyError('key')\n"
        "    return values[kind]\n"
    ),
}


def test_plain_values_cross_exactly_and_exceptions_keep_their_type():
    """Types (tuple vs list, set, bytes, None keys), NaN, infinities and big integers reach
    the tests as the solution returned them; a builtin exception is caught as that type."""
    env = envhub.make("code/humaneval-v0", dataset=[PLAIN], test_timeout_s=5.0)
    try:
        env.reset(seed=0)
        reply, reward, _, _, info = env.step(env.unwrapped.expert_action())
        assert info["passed"] == info["total"] == 6, reply[0]["content"]
        assert math.isclose(reward, 1.0)
    finally:
        env.close()


def test_a_solution_that_ends_its_process_fails_the_test_it_was_in_and_the_rest_do_not_run(env):
    env.reset(seed=0)
    code = "import os\ndef add(a, b):\n    os._exit(3)\n"
    reply, reward, *_ = env.step(f"```python\n{code}```")
    text = reply[0]["content"]
    assert reward == 0.0
    assert "your code's process exited with code 3" in text, text
    assert "not run: your code's process exited with code 3 in an earlier test" in text, text


def test_a_runner_report_of_the_wrong_shape_is_never_a_reward(monkeypatch, env):
    """The report is checked (a sandbox image whose runner misbehaves, or a bug): more results
    than tests, or a `passed` that is not a bool, is the solution's failure, not a reward."""
    env.reset(seed=0)
    forged = {
        "solution_error": None,
        "results": [{"test": "t", "passed": True, "error": None}] * 1000,
        "output": "",
    }
    for report in (forged, {**forged, "results": [{"passed": 1, "error": None}] * 4}):
        program = f"import sys\nprint(sys.stdin.readline().strip(), {json.dumps(report)!r})\n"
        monkeypatch.setattr(programming, "RUNNER", program)
        reply, reward, *_ = env.step(f"```python\n{WRONG}```")
        assert reward == 0.0 and "report was unreadable" in reply[0]["content"]


@pytest.mark.parametrize("same_python", [True, False])
def test_the_runner_runs_compiled_or_from_source(tmp_path, same_python):
    """A run writes the runner compiled by the host's Python and its source: a sandbox whose
    Python reads that bytecode runs it without compiling, any other compiles the source."""
    import subprocess
    import sys

    from envs.code.harness import runner_files

    files = runner_files("import sys\nprint('ran', __name__, sys.argv[0])\n")
    if not same_python:  # a sandbox image with another Python
        files["runner.py"] = files["runner.py"].replace(sys.implementation.cache_tag.encode(), b"x")
        files["runner.bin"] = b"not bytecode of this Python"
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    out = subprocess.run(
        [sys.executable, "-I", "runner.py"],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert out.stdout == "ran __main__ runner.py\n", out.stderr


def _cases_from_feedback(text: str, table: dict[str, object]) -> None:
    """What a memorising policy reads from feedback: each ``assert candidate(ARGS) == WANT``
    it is shown, as a lookup table entry (the reviewer's policy, /tmp/review-reward)."""
    import ast
    import re

    for found in re.finditer(r"^- (assert .*)$", text, re.MULTILINE):
        try:
            node = ast.parse(found.group(1)).body[0].test  # type: ignore[attr-defined]
        except (SyntaxError, AttributeError):
            continue
        call, want = None, None
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
            call, want = node.left, node.comparators[0]
        elif isinstance(node, ast.Call):
            call, want = node, ast.Constant(True)
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
            continue
        try:
            args = tuple(ast.literal_eval(a) for a in call.args)
            table[repr(args)] = ast.literal_eval(want)
        except (ValueError, SyntaxError, TypeError):
            continue


def test_feedback_does_not_hand_out_the_expected_values_of_the_tests_that_score():
    """A policy that only copies the failing tests shown in feedback into a lookup table
    earns what its first (constant) attempt earned: the revisions gain nothing."""
    env = envhub.make("code/humaneval-v0")
    try:
        gained, successes = [], 0
        for index in range(0, 164, 4):
            env.reset(seed=0, options={"task_index": index})
            entry, table, first, ret = env.unwrapped.task["entry_point"], {}, None, 0.0
            while not env.unwrapped.done:
                code = (
                    f"_T = {table!r}\ndef {entry}(*args):\n    return _T.get(repr(args), False)\n"
                )
                reply, reward, _, _, info = env.step(f"```python\n{code}```")
                first = reward if first is None else first
                ret += reward
                _cases_from_feedback(reply[-1]["content"], table)
            gained.append(ret - first)
            successes += info["success"]
        assert successes == 0 and max(gained) == 0.0, (successes, sum(gained))
    finally:
        env.close()


def test_a_solution_raising_stopiteration_fails_tests_that_iterate_with_map():
    """StopIteration from the solution must not end the test's map()/filter() early."""
    task = {
        "id": "sq",
        "prompt": 'def square(x):\n    """x squared."""\n',
        "entry_point": "square",
        "tests": [
            "assert all(map(lambda x: square(x) == x * x, range(10)))",
            "for got, x in zip(map(square, [1, 2, 3]), [1, 2, 3]):\n    assert got == x * x",
            "assert list(filter(lambda x: square(x) == 4, [1, 2, 3])) == [2]",
        ],
    }
    env = envhub.make("code/humaneval-v0", dataset=[task])
    try:
        env.reset(seed=0)
        reply, reward, *_, info = env.step(
            "```python\ndef square(x):\n    raise StopIteration\n```"
        )
        assert (reward, info["passed"]) == (0.0, 0), reply[0]["content"]
        assert "StopIteration" in reply[0]["content"]
    finally:
        env.close()
