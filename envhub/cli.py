"""The ``envhub`` command line: list, inspect, check, play and evaluate environments.

Each command is a thin layer over the Python API (``envhub.list_envs``, ``envhub.spec``,
``envhub.check_env``, ``envhub.play``, ``envhub.evaluate``); heavy imports happen inside the
command that needs them, so ``envhub --help`` stays instant. Later subsystems add their own
commands (``serve``, ``train``, ``bench``) to the ``main`` group.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import warnings
from typing import Any, NoReturn, TextIO

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from envhub import __version__
from envhub.errors import EnvhubError
from envhub.extras import install_command

__all__ = ["main"]

console = Console()
err_console = Console(stderr=True)


def _parse_kwargs(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``("size=8", "slippery=true")`` -> ``{"size": 8, "slippery": True}`` (JSON values)."""
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(
                f"{pair!r} is not key=value (e.g. -k size=8)", param_hint="--kwarg"
            )
        try:
            kwargs[key] = json.loads(raw)
        except json.JSONDecodeError:
            kwargs[key] = raw
    return kwargs


class LazyGroup(click.Group):
    """A command group whose subsystem commands are imported only when invoked.

    ``LAZY_COMMANDS`` maps a command name to ``"module:attr"`` (a ``click.Command``). Each
    subsystem (sandboxes, server, trainer) keeps its command next to its code and adds one
    line here, so ``envhub --help`` stays fast and never imports torch, ray or fastapi.
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in LAZY_COMMANDS:
            module_name, _, attr = LAZY_COMMANDS[name].partition(":")
            return getattr(importlib.import_module(module_name), attr)
        return super().get_command(ctx, name)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ModuleNotFoundError as error:
            missing = (error.name or "").split(".")[0]
            fix = install_command(missing)
            err_console.print(
                f"[bold red]error:[/] this needs the optional package {missing!r}, which is not "
                f"installed; install it with: {escape(fix)}",
                highlight=False,
                soft_wrap=True,
            )
            sys.exit(2)


LAZY_COMMANDS: dict[str, str] = {
    "check": "envhub.check_cli:check_command",
    "serve": "envhub.server.cli:serve",
    "sandbox": "sandboxes.cli:sandbox",
    "train": "trainer.cli:train",
    "eval": "envhub.eval_cli:eval_command",
    "view": "envhub.view.cli:view_command",
}
"""Subsystem commands: name -> "module:click_command"."""


def _fail(error: Exception) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False, soft_wrap=True)
    sys.exit(2)


def _import_plugins(ctx: click.Context, param: click.Parameter, targets: tuple[str, ...]) -> None:
    """``--import``: load the modules now (one that fails is an error, exit 2), and name them in
    ``ENVHUB_PLUGINS`` for the processes the command starts."""
    if not targets:
        return
    from envhub.plugins import import_plugins

    for failure in import_plugins(targets):
        if not failure.collision:  # (a collision is reported where its ids are used)
            _fail(
                EnvhubError(
                    f"--import {failure.target}: {failure.error} (a module is looked up on "
                    "PYTHONPATH, then in the current folder)"
                )
            )


import_option = click.option(
    "--import",
    "plugin_modules",
    multiple=True,
    metavar="MODULE",
    expose_value=False,
    callback=_import_plugins,
    help="Import MODULE (or call MODULE:FUNC) first, for the ids it registers with "
    "envhub.register (repeatable; the same as ENVHUB_PLUGINS=MODULE,...).",
)
"""The ``--import MODULE`` option of the commands that use env ids (check, play, info, eval,
serve, list): ids a script registers reach the CLI without a package."""


def _show_envhub_warnings() -> None:
    """Print envhub's own warnings (a plugin collided, an id's namespace has a failed plugin)
    as one ``warning:`` line on stderr; other warnings print as Python prints them."""
    shown = warnings.showwarning
    if getattr(shown, "envhub", False):
        return

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        text = str(message)
        if not text.startswith("envhub: "):
            shown(message, category, filename, lineno, file, line)
            return
        err_console.print(
            f"[yellow]warning:[/] {escape(text.removeprefix('envhub: '))}",
            highlight=False,
            soft_wrap=True,
        )

    show.envhub = True  # type: ignore[attr-defined]
    warnings.showwarning = show


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(__version__, "-V", "--version", prog_name="envhub")
def main() -> None:
    """envhub: a hub of multi-turn text environments for language-model agents.

    \b
    Try:
      envhub list                         every environment id
      envhub info games/sokoban-v0        what an env is and how to configure it
      envhub play games/sokoban-v0        play it yourself in the terminal
      envhub check games/sokoban-v0       does it keep the TextEnv contract?
      envhub eval --episodes 10           random vs expert agents over the games
      envhub eval ENV --model URL         any OpenAI-compatible model on any env
      envhub init acme                    start a package of your own envs
    """
    # Plugin failures are shown by `envhub list` (and named in unknown-id errors, and in one
    # warning when a command uses an id of their namespace), not as Python warnings in the
    # middle of every command's output.
    warnings.filterwarnings("ignore", message="envhub: plugin", category=RuntimeWarning)
    _show_envhub_warnings()
    # torch's OpenMP threads (and those of the workers and engines a command starts) wait
    # between parallel regions by sleeping, not spinning: spinning waiters took the cores from
    # the working threads on a small or shared CPU machine (in-process GRPO on 2 loaded cores
    # ran 5x slower). Set before any command imports torch; a value set outside wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@main.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--namespace", "-n", default=None, help="Only ids in this namespace (e.g. games).")
@click.option(
    "--source",
    "-s",
    default=None,
    help="Only ids from this source (textarena, gem, reasoning-gym, openenv, envhub.games, ...).",
)
@click.option("--no-variants", is_flag=True, help="Hide size/difficulty variants.")
@import_option
def list_command(
    as_json: bool, namespace: str | None, source: str | None, no_variants: bool
) -> None:
    """List registered environments (built-in and from installed plugins).

    A table on a terminal; piped, one tab-separated line per env (id, max turns, source,
    description), for grep and cut.
    """
    from envhub.registry import list_envs, plugin_errors

    failures = plugin_errors()
    specs = list_envs(None, variants=not no_variants)
    if namespace is not None:
        specs = _chosen(specs, "namespace", namespace, failures)
    if source is not None:
        specs = _chosen(specs, "source", source, failures)
    if as_json:
        listing = [
            {
                "id": s.id,
                "family": s.family,
                "variant": s.variant,
                "description": s.description,
                "max_turns": s.max_turns,
                "kwargs": s.kwargs,
                "source": s.source,
                "entry_point": s.entry_point
                if isinstance(s.entry_point, str)
                else repr(s.entry_point),
            }
            for s in specs
        ]
        click.echo(
            json.dumps(
                {"envs": listing, "plugin_errors": [f.__dict__ for f in failures]},
                indent=2,
                default=repr,
            )
        )
        return
    rows = [
        (
            s.id,
            str(s.kwargs.get("max_turns", s.max_turns) or "-"),
            s.source,
            s.description
            if s.variant is None
            else f"variant of {s.family}: " + ", ".join(f"{k}={v}" for k, v in s.kwargs.items()),
        )
        for s in specs
    ]
    if not console.is_terminal:  # piped (`envhub list | grep ...`): one whole line per env
        for row in rows:
            click.echo("\t".join(" ".join(cell.split()) for cell in row))
    else:
        table = Table(title=f"{len(specs)} environments", title_justify="left")
        table.add_column("id", no_wrap=True)
        table.add_column("max turns", justify="right")
        table.add_column("source")
        table.add_column("description", overflow="fold")
        for row in rows:
            table.add_row(*map(escape, row))  # plugin text is text, not markup
        console.print(table)
    for failure in failures:
        what = "refused an id" if failure.collision else "failed to load"
        err_console.print(
            (
                f"[yellow]plugin {escape(repr(failure.name))} ({escape(failure.target)}) {what}:"
                f"[/] {escape(failure.error)}"
            ),
            highlight=False,
            soft_wrap=True,
        )


def _chosen(specs: list[Any], field: str, value: str, failures: list[Any]) -> list[Any]:
    """The specs whose ``field`` (``namespace`` or ``source``) is ``value``; one that holds no
    ids is an error saying why it is empty (an adapter not installed, a plugin that failed) or
    naming the values there are."""
    from envhub.adapters import SOURCES, did_you_mean
    from envhub.registry import registry

    chosen = [s for s in specs if getattr(s, field) == value]
    if chosen:
        return chosen
    note = registry.namespace_notes().get(value)
    if note is not None:
        _fail(EnvhubError(note))
    failed = next((f for f in failures if f.name == value), None)
    if failed is not None:
        _fail(EnvhubError(f"the plugin {value!r} failed to load: {failed.error}"))
    if value in SOURCES:
        return chosen  # installed, with no ids (openenv with no env package installed)
    known = sorted({getattr(s, field) for s in registry.list_envs()} | set(SOURCES))
    _fail(
        EnvhubError(
            f"no {field} named {value!r}.{did_you_mean(value, known)} "
            f"{field.capitalize()}s: {', '.join(known)}"
        )
    )


@main.command("info")
@click.argument("env_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@import_option
def info_command(env_id: str, as_json: bool) -> None:
    """Describe one environment: entry point, kwargs, variants, first observation."""
    import inspect

    from envhub.registry import list_envs, spec

    try:
        s = spec(env_id)
        accepted = s.accepted_kwargs()
        target = s.load_entry_point()
    except (EnvhubError, ImportError) as error:
        _fail(error)
    env = _build(s)
    try:
        messages, info = env.reset(seed=0)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001 - the env's error, said in one line
        from envhub.play import describe_env_error

        _fail(
            EnvhubError(
                f"{describe_env_error(error, 'reset(seed=0)')}; envhub check {s.id} says more"
            )
        )
    finally:
        with contextlib.suppress(Exception):
            env.close()
    variants = [v.id for v in list_envs() if v.family == s.family and v.id != s.id]
    doc = inspect.getdoc(target) or ""
    data = {
        "id": s.id,
        "description": s.description,
        "entry_point": s.entry_point if isinstance(s.entry_point, str) else repr(s.entry_point),
        "kwargs": s.kwargs,
        "max_turns": s.kwargs.get("max_turns", s.max_turns),
        "accepted_kwargs": accepted,
        "variants": variants,
        "source": s.source,
        "tools": info.get("tools", []),
        "first_observation": messages,
    }
    if as_json:
        click.echo(json.dumps(data, indent=2, default=repr))
        return
    console.print(
        f"[bold]{escape(s.id)}[/]  ({escape(s.source)})  {escape(s.description)}", highlight=False
    )
    if doc:
        console.print(doc.splitlines()[0], style="dim", highlight=False, markup=False)
    for key in ("entry_point", "kwargs", "max_turns", "accepted_kwargs", "variants"):
        console.print(f"  {key:16} {data[key]}", highlight=False, markup=False)
    if data["tools"]:
        console.print(
            f"  {'tools':16} {[t['function']['name'] for t in data['tools']]}", markup=False
        )
    console.print("first observation (seed 0):", style="bold")
    for message in messages:
        console.print(f"[{message['role']}]", style="cyan", markup=False)
        console.print(message["content"], markup=False, highlight=False)


@main.command("init")
@click.argument("name")
@click.option(
    "--dir",
    "parent",
    default=".",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Create the package folder NAME inside this folder.",
)
def init_command(name: str, parent: str) -> None:
    """Create an env package NAME: one env class, its entry point, a test, a README."""
    from pathlib import Path

    from envhub.scaffold import scaffold

    try:
        root = scaffold(name, Path(parent))
    except EnvhubError as error:
        _fail(error)
    console.print(f"[green]created[/] {escape(str(root))}", highlight=False)
    console.print(
        f"next:\n  pip install -e {root}\n  envhub check {name}/guess-v0\n"
        f"  pytest {root / 'tests'}",
        highlight=False,
        markup=False,
    )


@main.command("play")
@click.argument("env_id")
@click.option(
    "--seed", default=None, type=int, help="Seed of the first episode (then +1 each episode)."
)
@click.option(
    "--kwarg", "-k", "kwargs", multiple=True, help="Constructor override key=value (repeatable)."
)
@click.option("--replay", "replay_run", default=None, help="Run folder of an episode to replay.")
@click.option("--episode", "episode_key", default=None, help="The episode's key (kind:step:index).")
@import_option
def play_command(
    env_id: str,
    seed: int | None,
    kwargs: tuple[str, ...],
    replay_run: str | None,
    episode_key: str | None,
) -> None:
    """Play an environment yourself: read observations, type actions; or replay a stored
    episode's actions (``--replay RUN_DIR --episode KEY``, the command ``envhub view`` shows)."""
    from envhub.play import play
    from envhub.registry import spec

    read_line = None
    options = _parse_kwargs(kwargs)
    if replay_run is not None or episode_key is not None:
        read_line, stored_seed, run_kwargs = _replayed_actions(replay_run, episode_key, env_id)
        seed = stored_seed if seed is None else seed  # the stored episode's task, unless told
        options = {**run_kwargs, **options}
    try:
        found = spec(env_id)
        found.constructor_kwargs(options)
    except (EnvhubError, ImportError) as error:
        _fail(error)
    env = _build(found, **options)
    try:
        play(env, seed=seed, console=console, read_line=read_line)
    finally:
        with contextlib.suppress(Exception):
            env.close()


def _build(found: Any, **options: Any) -> Any:
    """The env ``found`` (an ``EnvSpec``) builds; any error it raises is one line, exit 2."""
    from envhub.check_workers import why_build_failed

    try:
        return found.make(**options)
    except KeyboardInterrupt:
        raise
    except EnvhubError as error:
        _fail(error)
    except BaseException as error:  # noqa: BLE001 - the env's error, said in one line
        _fail(EnvhubError(why_build_failed(error)))


def _replayed_actions(
    run_dir: str | None, key: str | None, env_id: str
) -> tuple[Any, int | None, dict[str, Any]]:
    """A ``read_line`` that types a stored episode's actions, then quits; with the episode's
    seed and the env kwargs its run used."""
    from envhub.parsing import message_text
    from envhub.runs import NotARunError, open_run

    if run_dir is None or key is None:
        _fail(EnvhubError("--replay RUN_DIR needs --episode KEY (both, as envhub view shows)"))
    try:
        run = open_run(run_dir)
        episode = run.episode(key)
    except (NotARunError, KeyError) as error:
        _fail(EnvhubError(str(error).strip("'\"")))
    actions = [message_text(m) for m in episode["messages"] if m.get("role") == "assistant"]
    lines = iter([*actions, ":quit"])

    def read_line(prompt: str) -> str:
        line = next(lines, ":quit")
        console.print(f"{prompt}{line}", highlight=False, markup=False)
        return line

    seed = episode.get("seed")
    return read_line, None if seed is None else int(seed), run.env_kwargs(env_id)


if __name__ == "__main__":  # pragma: no cover
    main()
