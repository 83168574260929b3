"""How fast the guards answer: the speed bounds the tests used to assert, measured instead.

The tests check that each guard *works* (the runaway is refused, the hung step is killed, the
flood is cut at the cap); a test timeout catches a guard that never answers. How *fast* each
answers depends on the machine's load, so it is measured here, side by side, against the bound
the tests once asserted (issue 21: no timing assertions in tests).

    python benchmarks/speed_checks.py [--only NAME,...]

One line per check: ``name  seconds  (former bound)  within|OVER``. Last line:
``speed_checks_over_bound: N of M``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

# the repo root: tests/ holds the pool's faulty env
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def calculator_runaway() -> float:
    from envs.tools.base import ToolError
    from envs.tools.calculator import safe_eval

    def refuse(expression: str) -> None:
        try:
            safe_eval(expression)
        except ToolError:
            return
        raise AssertionError(f"{expression!r} was not refused")

    return max(timed(lambda e=e: refuse(e)) for e in ("9**9**9", "10**99 * 10**99", "1" * 600))


def sql_runaway() -> float:
    import envhub

    env = envhub.make("tools/sql-v0")
    env.reset(seed=1)
    query = "SELECT COUNT(*) FROM employees a, employees b, employees c, employees d, employees e"
    try:
        return timed(
            lambda: env.step(
                f'<tool_call>{{"name": "run_sql", "arguments": {{"query": "{query}"}}}}</tool_call>'
            )
        )
    finally:
        env.close()


def mcp_tool_timeout() -> float:
    import json

    from envs.tools.mcp_bridge import McpEnv

    env = McpEnv(hidden_tools=[], call_timeout_s=1.5)
    try:
        env.reset(seed=0)
        call = {"name": "slow_echo", "arguments": {"text": "hi", "seconds": 600}}
        action = f"<tool_call>{json.dumps(call)}</tool_call>"
        return timed(lambda: env.step(action))
    finally:
        env.close()


def sokoban_solver_10x10() -> float:
    import envhub
    from envs.games.sokoban import solve

    env = envhub.make("games/sokoban-10x10-v0")
    worst = 0.0
    for seed in range(10):
        env.reset(seed=seed)
        worst = max(worst, timed(lambda: solve(env.level)))
    return worst


def humaneval_infinite_loop() -> float:
    import envhub

    tasks = [
        {
            "id": "add",
            "prompt": "def add(a, b):\n    pass\n",
            "entry_point": "add",
            "tests": ["assert add(1, 2) == 3"],
        }
    ]
    env = envhub.make(
        "code/humaneval-v0", dataset=tasks, test_timeout_s=1.0, wall_time_s=10, memory_mb=256
    )
    try:
        env.reset(seed=0)
        return timed(
            lambda: env.step("```python\ndef add(a, b):\n    while True:\n        pass\n```")
        )
    finally:
        env.close()


def terminal_sleep() -> float:
    import envhub

    env = envhub.make("code/terminal-v0", command_timeout_s=1.5)
    try:
        env.reset(options={"task_id": "make-tree-000"})
        return timed(lambda: env.step("```bash\nsleep 600\n```"))
    finally:
        env.close()


def _sandbox_run(command: str | list[str], timeout: float, **limits: object) -> float:
    from sandboxes import Limits
    from sandboxes.local import LocalSandbox

    sandbox = LocalSandbox(limits=Limits(**{"wall_time_s": 30.0, **limits})).start()  # type: ignore[arg-type]
    try:
        return timed(lambda: sandbox.run(command, timeout=timeout))
    finally:
        sandbox.stop()


def sandbox_loop_kill() -> float:
    return _sandbox_run(["python3", "-c", "while True: pass"], 1.0, cpu_time_s=60)


def sandbox_fork_bomb() -> float:
    return _sandbox_run("bomb() { bomb | bomb & }; bomb; wait", 3.0, max_processes=32)


def sandbox_output_flood() -> float:
    flood = (
        "import sys\nwhile True:\n    sys.stdout.write('x' * 4096); sys.stderr.write('y' * 4096)\n"
    )
    return _sandbox_run(["python3", "-c", flood], 30.0, max_output_bytes=50_000)


def pool_hung_step() -> float:
    from envhub.pool import EnvPool
    from tests.envhub.pool.faulty_envs import FAULTY

    async def main() -> float:
        async with EnvPool(FAULTY, num_workers=1, step_timeout_s=1.0) as pool:
            episode = await pool.reset(seed=0)
            start = time.perf_counter()
            await pool.step(episode.episode, "hang")
            return time.perf_counter() - start

    return asyncio.run(main())


CHECKS: dict[str, tuple[Callable[[], float], float, str]] = {
    "calculator_runaway": (calculator_runaway, 0.5, "tests/envs/tools/test_tools_specific.py"),
    "sql_runaway": (sql_runaway, 10.0, "tests/envs/tools/test_tools_specific.py"),
    "mcp_tool_timeout_1.5s": (mcp_tool_timeout, 5.0, "tests/envs/tools/test_mcp_bridge.py"),
    "sokoban_solver_10x10_worst": (sokoban_solver_10x10, 1.5, "tests/envs/games/test_sokoban.py"),
    "humaneval_infinite_loop_step": (
        humaneval_infinite_loop,
        15.0,
        "tests/envs/code/test_code_envs.py",
    ),
    "terminal_sleep_600_step": (terminal_sleep, 10.0, "tests/envs/code/test_code_envs.py"),
    "sandbox_loop_kill_after_1s": (sandbox_loop_kill, 5.0, "tests/sandboxes/test_adversarial.py"),
    "sandbox_fork_bomb_3s": (sandbox_fork_bomb, 13.0, "tests/sandboxes/test_adversarial.py"),
    "sandbox_output_flood": (sandbox_output_flood, 15.0, "tests/sandboxes/test_adversarial.py"),
    "pool_hung_step_1s": (pool_hung_step, 10.0, "tests/envhub/pool/test_pool.py"),
}
"""name -> (measure, the bound the test asserted in seconds, where it was asserted)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", default="", help=f"comma-separated subset of: {', '.join(CHECKS)}"
    )
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(CHECKS)
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        parser.error(f"unknown check(s) {unknown}; use some of {list(CHECKS)}")
    over = 0
    for name in names:
        measure, bound, where = CHECKS[name]
        seconds = measure()
        over += seconds > bound
        print(
            f"{name:30s} {seconds:8.3f} s  (was asserted < {bound:g} s in {where})  "
            f"{'OVER' if seconds > bound else 'within'}",
            flush=True,
        )
    print(f"speed_checks_over_bound: {over} of {len(names)}")


if __name__ == "__main__":
    main()
