"""``envhub sandbox``: try a sandbox backend by hand.

```console
$ envhub sandbox run --backend local -- python3 -c "print(1)"
$ envhub sandbox run --timeout 2 -- sh -c ':(){ :|:& };:'      # a fork bomb, contained
$ envhub sandbox info                                           # which backends work here
```

Only click is imported at module level; the sandbox code loads when a command runs.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

__all__ = ["sandbox"]


@click.group()
def sandbox() -> None:
    """Run commands in isolated sandboxes (local namespaces, Docker, E2B)."""


def _limits_options(fn: Any) -> Any:
    options = [
        click.option(
            "--timeout",
            "wall_time_s",
            type=float,
            default=10.0,
            show_default=True,
            help="Wall-time limit (s).",
        ),
        click.option(
            "--cpu",
            "cpu_time_s",
            type=float,
            default=10.0,
            show_default=True,
            help="CPU seconds per process.",
        ),
        click.option(
            "--memory-mb",
            type=int,
            default=512,
            show_default=True,
            help="Memory cap of the sandbox.",
        ),
        click.option(
            "--max-processes",
            type=int,
            default=64,
            show_default=True,
            help="Processes alive at once.",
        ),
        click.option(
            "--max-output-bytes",
            type=int,
            default=1_000_000,
            show_default=True,
            help="Kept per stream.",
        ),
        click.option(
            "--disk-mb", type=int, default=256, show_default=True, help="Size of scratch and /tmp."
        ),
        click.option(
            "--network/--no-network", default=False, show_default=True, help="Allow network access."
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@sandbox.command("run", context_settings={"ignore_unknown_options": True})
@click.option(
    "--backend",
    "-b",
    type=click.Choice(["local", "docker", "e2b"]),
    default="local",
    show_default=True,
)
@click.option("--image", default=None, help="Docker image (docker backend).")
@click.option(
    "--isolation",
    type=click.Choice(["auto", "bwrap", "unshare"]),
    default="auto",
    show_default=True,
    help="How the local backend isolates.",
)
@click.option("--stdin", "stdin_text", default=None, help="Text fed to the command's stdin.")
@click.option("--json", "as_json", is_flag=True, help="Print the ExecResult as JSON.")
@_limits_options
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run_command(
    backend: str,
    image: str | None,
    isolation: str,
    stdin_text: str | None,
    as_json: bool,
    command: tuple[str, ...],
    **limit_fields: Any,
) -> None:
    """Run COMMAND (after --) in a fresh sandbox and report what happened.

    The exit status is the command's (128+N when signal N killed it); a line on stderr says
    which limit, if any, stopped it.
    """
    from sandboxes import Limits, SandboxError, make_sandbox

    try:
        limits = Limits(**limit_fields)
        kwargs: dict[str, Any] = {}
        if backend == "local":
            kwargs["isolation"] = isolation
        if backend == "docker" and image:
            kwargs["image"] = image
        with make_sandbox(backend, limits=limits, **kwargs) as sb:
            result = sb.run(list(command), stdin=stdin_text)
            where = f"{backend}/{sb.isolation}" if backend == "local" else backend  # type: ignore[attr-defined]
    except SandboxError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    if as_json:
        click.echo(json.dumps({"backend": where, **result.to_dict()}, indent=2))
    else:
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        if result.stdout and not result.stdout.endswith("\n"):
            sys.stdout.write("\n")
        network = "network on" if limits.network else "network off"
        click.echo(f"[sandbox {where}, {network}] {result.describe()}", err=True)
    sys.exit(min(result.exit_code, 255))


@sandbox.command("gc")
def gc_command() -> None:
    """Remove scratch mounts, cgroups and dirs left by local sandboxes of dead processes."""
    from sandboxes._footprint import collect_stale

    removed = collect_stale()
    for path in removed:
        click.echo(f"removed {path}")
    click.echo(f"{len(removed)} stale local sandbox(es) cleaned up")


@sandbox.command("info")
@click.option(
    "--backend",
    "-b",
    type=click.Choice(["local", "docker", "e2b"]),
    default=None,
    help="Only this backend (default: all).",
)
def info_command(backend: str | None) -> None:
    """Say which backends work on this host, what each protects against (and the tests that
    attack each property), what it does not, and what the local one enforces here."""
    from sandboxes import Limits, SandboxError, backend_class, make_sandbox

    for name in [backend] if backend else ["local", "docker", "e2b"]:
        try:
            with make_sandbox(name, limits=Limits(wall_time_s=10)) as sb:
                ok = sb.run(["true"]).exit_code == 0
                click.echo(f"{name}: {'works' if ok else 'started, but `true` failed'}")
                for key, value in getattr(sb, "protections", {}).items():
                    click.echo(f"  {key:10} {value}")
        except SandboxError as e:
            click.echo(f"{name}: unavailable: {e}")
        try:
            cls = backend_class(name)
        except ImportError:  # its SDK is not installed: nothing more to say
            continue
        if cls.PROTECTS:
            click.echo("  protects against (property: how; guarded by):")
            for p in cls.PROTECTS:
                click.echo(
                    f"    - {p.name}: {p.how}; " + ", ".join(t.rsplit("::", 1)[-1] for t in p.tests)
                )
        for line in cls.NOT_PROTECTED:
            click.echo(f"  not protected: {line}")
