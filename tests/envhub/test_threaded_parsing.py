"""Envs made and stepped on many threads at once (``envhub eval``'s workers, env pools, the
trainer's env managers) never fail on CPython's AST constructor: on 3.11 two threads building
trees at once raised ``SystemError: AST constructor recursion depth mismatch`` (a CI run's
``envhub eval`` lost episodes to it as ``env_error``). A collector that yields the GIL in
finalizers makes the interleaving happen within a few parses."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from envhub.signatures import accepted_keywords
from envhub.tool_calls import ToolCallParser
from envs.code.harness import split_tests
from envs.tools.calculator import safe_eval
from trainer.rollout.tool_parsers import make_tool_parser


class _Yields:
    """Garbage only the collector frees, whose finalizer lets another thread run."""

    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        time.sleep(0)


@pytest.fixture
def switching_collector() -> Iterator[None]:
    stop = threading.Event()

    def litter() -> None:
        while not stop.is_set():
            _Yields()
            time.sleep(0)

    threshold = gc.get_threshold()
    gc.set_threshold(50)
    thread = threading.Thread(target=litter, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        gc.set_threshold(*threshold)


def on_threads(work: Callable[[], Any], times: int, threads: int = 3) -> list[BaseException]:
    errors: list[BaseException] = []

    def run() -> None:
        for _ in range(times):
            try:
                work()
            except BaseException as error:  # noqa: BLE001 - the test reports them all
                errors.append(error)
                return

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return errors


TESTS = "def check(candidate):\n" + "    assert candidate([1, (2, 3), {4: 5}]) == [1]\n" * 40


ARGUMENTS = repr({"a": [1, (2, 3)] * 30, "b": {"x": None}})
CALL = f"<tool_call>{{'name': 'f', 'arguments': {ARGUMENTS}}}</tool_call>"  # Python, not JSON
CALLS = f"[f(a={[1, 2, 3] * 30}, b={{'x': (1, 2)}})]"


def tool_arguments() -> None:
    [call] = ToolCallParser().parse(CALL)
    assert call.arguments["b"] == {"x": None}


def pythonic_calls() -> None:
    [call] = make_tool_parser("pythonic", prefer_vllm=False).parse(CALLS).tool_calls
    assert call.arguments["b"] == {"x": [1, 2]}


class _Base:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed


class _LongInit(_Base):
    """An env class whose ``__init__`` passes ``**kwargs`` on: ``make`` reads its source."""

    def __init__(self, size: int = 3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.table = [
            [(row, column, {"cell": row * column}) for column in range(size)] for row in range(size)
        ]
        self.field_0 = [0, (0, 1), {0: [0]}]
        self.field_1 = [1, (1, 2), {1: [1]}]
        self.field_2 = [2, (2, 3), {2: [2]}]
        self.field_3 = [3, (3, 4), {3: [3]}]
        self.field_4 = [4, (4, 5), {4: [4]}]
        self.field_5 = [5, (5, 6), {5: [5]}]
        self.field_6 = [6, (6, 7), {6: [6]}]
        self.field_7 = [7, (7, 8), {7: [7]}]
        self.field_8 = [8, (8, 9), {8: [8]}]
        self.field_9 = [9, (9, 10), {9: [9]}]
        self.field_10 = [10, (10, 11), {10: [10]}]
        self.field_11 = [11, (11, 12), {11: [11]}]
        self.field_12 = [12, (12, 13), {12: [12]}]
        self.field_13 = [13, (13, 14), {13: [13]}]
        self.field_14 = [14, (14, 15), {14: [14]}]
        self.field_15 = [15, (15, 16), {15: [15]}]
        self.field_16 = [16, (16, 17), {16: [16]}]
        self.field_17 = [17, (17, 18), {17: [17]}]
        self.field_18 = [18, (18, 19), {18: [18]}]
        self.field_19 = [19, (19, 20), {19: [19]}]
        self.field_20 = [20, (20, 21), {20: [20]}]
        self.field_21 = [21, (21, 22), {21: [21]}]
        self.field_22 = [22, (22, 23), {22: [22]}]
        self.field_23 = [23, (23, 24), {23: [23]}]
        self.field_24 = [24, (24, 25), {24: [24]}]
        self.field_25 = [25, (25, 26), {25: [25]}]
        self.field_26 = [26, (26, 27), {26: [26]}]
        self.field_27 = [27, (27, 28), {27: [27]}]
        self.field_28 = [28, (28, 29), {28: [28]}]
        self.field_29 = [29, (29, 30), {29: [29]}]
        self.field_30 = [30, (30, 31), {30: [30]}]
        self.field_31 = [31, (31, 32), {31: [31]}]
        self.field_32 = [32, (32, 33), {32: [32]}]
        self.field_33 = [33, (33, 34), {33: [33]}]
        self.field_34 = [34, (34, 35), {34: [34]}]
        self.field_35 = [35, (35, 36), {35: [35]}]
        self.field_36 = [36, (36, 37), {36: [36]}]
        self.field_37 = [37, (37, 38), {37: [37]}]
        self.field_38 = [38, (38, 39), {38: [38]}]
        self.field_39 = [39, (39, 40), {39: [39]}]


def make_arguments() -> None:  # what make checks before building an env
    assert accepted_keywords(_LongInit) == (["size", "seed"], True)


@pytest.mark.parametrize(
    ("work", "times"),
    [
        (make_arguments, 8),  # (inspect.getsource is slow under this collector)
        (lambda: safe_eval(" + ".join(["(1 * 2)"] * 45)), 30),
        (lambda: split_tests(TESTS, "f"), 30),
        (tool_arguments, 30),
        (pythonic_calls, 30),
    ],
    ids=["make", "calculator", "code-tests", "tool-arguments", "pythonic-calls"],
)
def test_parsing_on_many_threads_at_once_never_fails(
    switching_collector: None, work: Callable[[], Any], times: int
) -> None:
    assert on_threads(work, times=times) == []
