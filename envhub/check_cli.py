"""``envhub check``: run the contract checker on registered ids, each in a worker process.

Every id is checked in a process of its own (``envhub.check_workers``), within ``--timeout``
seconds: an env that hangs, exits, crashes or cannot be built fails its own report, the other
ids are still checked, and the summary names every failure (exit code 1). With ``--jobs 1``
each check prints as it ends; with more, each id's results print when it is done.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import click
from rich.markup import escape

from envhub.cli import _chosen, _fail, _parse_kwargs, console, import_option
from envhub.errors import EnvhubError, EnvKwargsError

if TYPE_CHECKING:
    from envhub.checker import CheckResult

__all__ = ["check_command"]

DEFAULT_TIMEOUT = 300.0
"""Seconds one id's checks may take by default (``--timeout``); a browser env's take ~20."""


@click.command("check")
@click.argument("env_ids", nargs=-1)
@click.option("--all", "check_all", is_flag=True, help="Check every registered id.")
@click.option(
    "--source",
    "-s",
    "sources",
    multiple=True,
    help="With --all: only ids from this source (repeatable; e.g. envhub.games, reasoning-gym).",
)
@click.option(
    "--seed", default=0, show_default=True, help="Seed for the episodes the checker plays."
)
@click.option(
    "--kwarg", "-k", "kwargs", multiple=True, help="Constructor override key=value (repeatable)."
)
@click.option("--no-gymnasium", is_flag=True, help="Skip Gymnasium's own env checker.")
@click.option(
    "--jobs",
    "-j",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Check this many ids at once, in worker processes (each id's results print when done).",
)
@click.option(
    "--timeout",
    default=DEFAULT_TIMEOUT,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds each id's checks may take; an env still busy then fails the check it is in.",
)
@import_option
def check_command(
    env_ids: tuple[str, ...],
    check_all: bool,
    sources: tuple[str, ...],
    seed: int,
    kwargs: tuple[str, ...],
    no_gymnasium: bool,
    jobs: int,
    timeout: float,
) -> None:
    """Check that environments keep the TextEnv contract; exit code 1 on any failure.

    Each id runs in a worker process of its own: one that hangs (past --timeout), exits,
    crashes or cannot be built fails, and the others are still checked. Besides random play on
    several seeds (one near 1e9, where the trainer's eval seeds are), the env's expert plays to
    the end, each seed is replayed after another and on a fresh env, and once per entry point
    in a new Python process with another PYTHONHASHSEED.
    """
    from envhub.check_workers import check_ids

    overrides = _parse_kwargs(kwargs)
    ids = _selected_ids(env_ids, check_all, sources, overrides)
    printed: dict[str, int] = {}  # id -> how many of its results are on screen

    def show(env_id: str, result: CheckResult) -> None:
        if env_id not in printed:
            console.print(f"[bold]{escape(env_id)}[/]", highlight=False)
            printed[env_id] = 0
        printed[env_id] += 1
        _print_result(result)

    failed = []
    reports = check_ids(
        ids,
        jobs=jobs,
        kwargs=overrides,
        seed=seed,
        gymnasium_checks=not no_gymnasium,
        timeout=timeout,
        on_result=show if jobs == 1 else None,  # one id at a time: print each check live
    )
    with _sigterm_exits(), contextlib.closing(reports):
        for report in reports:
            for result in report.results[printed.get(report.env_name, 0) :]:
                show(report.env_name, result)
            if not report.ok:
                failed.append(report.env_name)
    if failed:
        console.print(
            f"[red]{len(failed)} of {len(ids)} environment(s) failed:[/] "
            f"{escape(', '.join(failed))}",
            highlight=False,
        )
        sys.exit(1)
    console.print(f"[green]all {len(ids)} environment(s) passed[/]")


def _selected_ids(
    env_ids: tuple[str, ...], check_all: bool, sources: tuple[str, ...], overrides: dict[str, Any]
) -> list[str]:
    """The full ids to check; an unknown id or a ``-k`` key an env refuses fails here, before
    any work (exit code 2)."""
    from envhub.registry import list_envs, spec

    if sources and not check_all:
        raise click.UsageError("--source selects ids for --all; give --all too")
    if check_all and sources:
        specs: list[Any] = []
        for source in sources:
            specs += _chosen(list_envs(), "source", source, [])
    elif check_all:
        specs = list_envs()
    else:
        try:
            specs = [spec(env_id) for env_id in env_ids]
        except EnvhubError as error:
            _fail(error)
    if not specs:
        raise click.UsageError("give one or more env ids, or --all")
    for s in specs if overrides else []:
        try:
            s.constructor_kwargs(overrides)
        except EnvKwargsError as error:
            _fail(error)
        except KeyboardInterrupt:
            raise
        except BaseException:  # noqa: BLE001, S110 - its worker reports why it cannot be loaded
            pass
    return [s.id for s in specs]


def _print_result(result: CheckResult) -> None:
    mark = "[yellow]-[/]" if result.skipped else ("[green]✓[/]" if result.passed else "[red]✗[/]")
    message = escape(result.message)  # an env's text, not markup
    detail = (
        f" [dim]({message})[/]"
        if result.skipped
        else (f"\n      [red]{message}[/]" if not result.passed else "")
    )
    console.print(f"  {mark} {escape(result.name)}{detail}", highlight=False, soft_wrap=True)


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """While checking, SIGTERM ends the command the way Ctrl-C does: by an exception, so the
    worker processes are killed on the way out (its default action would orphan them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_now(signum: int, frame: Any) -> None:
        sys.exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
