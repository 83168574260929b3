"""How ``envhub eval`` shows its summaries: every number whole, at any width.

One row per (env, agent), in one of three layouts:

- a terminal wide enough for the whole table: the table;
- a narrower terminal: one record per row, the env and agent on a line and then
  ``name: value`` pairs, lines broken only between pairs (a table squeezed to fit cuts its
  numbers to "…", the command's whole result);
- piped (a log file, ``| grep``): a ``# title`` line, then tab-separated lines with a header
  first, as ``envhub list`` prints, whatever ``COLUMNS`` says.

``notes`` are the lines printed under it when a row is not what its numbers suggest: an
``expert`` row that was random play (its env has no expert), a model whose turns were
(nearly) all invalid actions, with what the env answered them and the likely causes (replies
cut off at ``--max-tokens`` only where the server said so; else a ``note:`` says how many
were), a ``note:`` for a row with episodes that ran out of time during the agent's turn
(``episode_timeout``: counted as the agent's, since a slow server and a slow model look the
same from here), and a ``warning:`` for a row where at least ``FAILED_WARN_SHARE`` of the
episodes failed at the endpoint or in the env.

Every figure counts every episode, one that failed as a loss. Where episodes failed at the
endpoint or in the env (``failed_outside_agent``), the table adds ``measured`` (the episodes
that measured the agent) and ``success (measured)`` (its success over those alone).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click
from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from envhub.eval_records import EvalSummary, failed_outside_agent

__all__ = ["notes", "show", "summary_table"]

Cell = Callable[["EvalSummary"], str]
_TEXT = ("env", "agent", "failures")
"""Columns of words (wrapped in the table); every other column is a number (never wrapped)."""
MIN_TEXT_WIDTH = 12
"""The narrowest the table makes a column of words (env, agent, failures); any narrower and
``show`` prints records instead."""
INVALID_HINT_RATE = 0.9
"""A model whose invalid actions per turn reach this gets a ``hint:`` line (``notes``)."""
FAILED_WARN_SHARE = 0.2
"""A row whose episodes failed at the endpoint or in the env in at least this share (but not
all: that is an error) gets a ``warning:`` line (``notes``): its success says little."""


def _columns(summaries: list[EvalSummary]) -> dict[str, Cell]:
    """Header -> plain-text cell: success, the measured episodes and their success (where some
    failed at the endpoint or env), pass@k with its 95% interval (several tries per seed),
    return, turns, invalid actions per turn, and for a model tokens, request latency and
    failures by reason; columns that would hold nothing for these summaries are left out."""
    k = max((s.samples for s in summaries), default=1)
    model = any(s.mean_tokens_in or s.mean_tokens_out for s in summaries)
    cells: dict[str, Cell] = {
        "env": lambda s: s.env_id,
        "agent": _agent_label,
        "episodes": lambda s: str(s.episodes),
        "success": lambda s: f"{s.success_rate:.0%}",
    }
    if any(s.measured < s.episodes for s in summaries):
        cells["measured"] = lambda s: str(s.measured)
        cells["success (measured)"] = lambda s: (
            f"{s.measured_success_rate:.0%}" if s.measured else "-"
        )
    if k > 1:
        cells[f"pass@{k} (95% CI)"] = lambda s: (
            f"{s.pass_at_k:.0%} ({s.pass_at_k_low:.0%}-{s.pass_at_k_high:.0%})"
        )
    cells["return"] = lambda s: f"{s.mean_return:+.2f}"
    cells["turns"] = lambda s: f"{s.mean_turns:.1f}"
    cells["invalid/turn"] = lambda s: f"{s.invalid_rate:.2f}"
    if model:
        cells["tokens in/out"] = lambda s: f"{s.mean_tokens_in:,.0f}/{s.mean_tokens_out:,.0f}"
        cells["latency p50/p95"] = lambda s: _latency(s.latency_p50_s, s.latency_p95_s)
    if any(s.failures for s in summaries):
        cells["failures"] = lambda s: (
            ", ".join(f"{reason} {n}" for reason, n in sorted(s.failures.items())) or "-"
        )
    return cells


def _agent_label(summary: EvalSummary) -> str:
    """The agent's name, saying how much of its row was random play (``random_turn_rate``)."""
    if summary.random_turn_rate >= 1.0:
        return f"{summary.agent} (none: random)"
    if summary.random_turn_rate > 0:
        return f"{summary.agent} ({summary.random_turn_rate:.0%} random)"
    return summary.agent


def _latency(p50: float, p95: float) -> str:
    if p95 >= 0.1:
        return f"{p50:.2f}/{p95:.2f} s"
    return f"{p50 * 1e3:.1f}/{p95 * 1e3:.1f} ms"


def summary_table(summaries: list[EvalSummary], title: str, width: int = 100_000) -> Table | None:
    """The table in at most ``width`` columns, or None where it cannot fit with every number
    whole: each number column is as wide as its longest value (its header may wrap between
    words), and the env and agent (and failures) columns share what is left, their text
    wrapped, down to ``MIN_TEXT_WIDTH`` each."""
    cells = _columns(summaries)
    rows = [[cell(s) for cell in cells.values()] for s in summaries]
    widths: dict[str, int] = {}
    natural: dict[str, int] = {}
    for i, name in enumerate(cells):
        longest = max([cell_len(row[i]) for row in rows], default=0)  # (terminal columns)
        if name in _TEXT:
            natural[name] = max(longest, len(name))
            widths[name] = min(natural[name], MIN_TEXT_WIDTH)
        else:
            widths[name] = max(longest, *(len(word) for word in name.split()))
    spare = width - (sum(widths.values()) + 3 * len(cells) + 1)  # + padding, rules and edges
    if spare < 0:
        return None
    for name, most in natural.items():  # (in column order: the env first)
        grow = min(most - widths[name], spare)
        widths[name], spare = widths[name] + grow, spare - grow
    table = Table(title=title, title_justify="left")
    for name in cells:
        text = name in _TEXT
        table.add_column(
            name, justify="left" if text else "right", width=widths[name], overflow="fold"
        )
    for row in rows:
        table.add_row(*map(escape, row))
    return table


def show(out: Console, summaries: list[EvalSummary], title: str) -> None:
    """Print ``summaries`` on ``out`` in the layout its width allows (module docstring)."""
    if not out.is_terminal:
        _tab_separated(summaries, title)
        return
    table = summary_table(summaries, title, out.width)
    if table is not None and out.measure(table).maximum <= out.width:
        out.print(table)
    else:
        _records(out, summaries, title)


def _tab_separated(summaries: list[EvalSummary], title: str) -> None:
    cells = _columns(summaries)
    click.echo(f"# {title}")
    click.echo("\t".join(cells))
    for s in summaries:
        click.echo("\t".join(" ".join(cell(s).split()) for cell in cells.values()))


def _records(out: Console, summaries: list[EvalSummary], title: str) -> None:
    cells = _columns(summaries)
    width = max(out.width - 2, 20)
    out.print(title, markup=False, highlight=False, soft_wrap=True)
    for s in summaries:
        out.print(f"{s.env_id}  {_agent_label(s)}", markup=False, highlight=False, soft_wrap=True)
        pairs = [f"{name}: {cell(s)}" for name, cell in cells.items() if name not in _TEXT[:2]]
        for line in _fill(pairs, width):
            out.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)


def _fill(pairs: list[str], width: int) -> list[str]:
    """``pairs`` joined by two spaces into lines of at most ``width`` (a longer pair stands
    alone on its line, whole)."""
    lines: list[str] = []
    for pair in pairs:
        if lines and cell_len(lines[-1]) + 2 + cell_len(pair) <= width:
            lines[-1] += "  " + pair
        else:
            lines.append(pair)
    return lines


def notes(
    summaries: list[EvalSummary],
    *,
    model: bool,
    said: dict[tuple[str, str], str],
    tool_envs: set[str],
    tools_mode: str,
    max_tokens: int,
    out: Path | None,
) -> list[str]:
    """The ``note:``/``hint:``/``warning:`` lines for rows that are not what they look like
    (module docstring). ``model``: the rows are a served model's; ``said``: per (env, agent),
    what the env answered a first invalid action (``EpisodeStats.invalid_feedback``);
    ``tool_envs``: the envs that published tools."""
    lines = []
    for s in summaries:
        if s.random_turn_rate >= 1.0:
            lines.append(
                f"note: {s.env_id} has no expert (expert_action() returned None): its "
                f"'{s.agent}' row is random play"
            )
        elif s.random_turn_rate > 0:
            lines.append(
                f"note: {s.env_id}: expert_action() returned None on {s.random_turn_rate:.0%} "
                f"of the '{s.agent}' turns, which were played at random"
            )
        if model and s.mean_turns > 0 and s.invalid_rate >= INVALID_HINT_RATE:
            feedback = said.get((s.env_id, s.agent), "")
            tools = s.env_id in tool_envs
            lines.append(_invalid_hint(s, feedback, tools, tools_mode, max_tokens, out))
        elif s.cut_off_rate > 0:
            lines.append(
                f"note: {s.env_id}: {s.cut_off_rate:.0%} of the replies were cut off at "
                f'--max-tokens {max_tokens} (finish_reason "length"); raise it if the model '
                "needs the room"
            )
        if s.failures.get("episode_timeout"):
            lines.append(_out_of_time_note(s, model))
        unmeasured = s.episodes - s.measured
        if 0 < unmeasured < s.episodes and unmeasured >= FAILED_WARN_SHARE * s.episodes:
            lines.append(_unmeasured_warning(s, out))
    return lines


def _out_of_time_note(s: EvalSummary, model: bool) -> str:
    timed_out = s.failures["episode_timeout"]
    said = f"note: {s.env_id} ({s.agent}): {timed_out} of {s.episodes} episodes ran past "
    if not model:
        return said + (
            "--episode-timeout during the agent's turn (episode_timeout): they count as its "
            "failures in every figure, the measured ones included"
        )
    return said + (
        "--episode-timeout during the model's turn (episode_timeout): they count as its "
        "failures in every figure, the measured ones included, since envhub cannot "
        "tell a server slow to answer from a model whose replies take that long (a request the "
        "server does not answer within --timeout fails as timeout, the endpoint's, instead); "
        "raise --episode-timeout if the model needs the time"
    )


def _unmeasured_warning(s: EvalSummary, out: Path | None) -> str:
    unmeasured = s.episodes - s.measured
    counts = ", ".join(
        f"{reason} {n}" for reason, n in sorted(s.failures.items()) if failed_outside_agent(reason)
    )
    again = (
        "fix the cause and run the same command with --resume to play them again"
        if out is not None
        else "fix the cause and run again (with --out DIR, a later --resume plays only those)"
    )
    return (
        f"warning: {s.env_id} ({s.agent}): {unmeasured} of {s.episodes} episodes failed at the "
        f"endpoint or in the env, not in the agent's play ({counts}); success is "
        f"{s.success_rate:.0%} counting them as losses, {s.measured_success_rate:.0%} over the "
        f"{s.measured} measured; {again}"
    )


def _invalid_hint(
    s: EvalSummary, said: str, tools: bool, tools_mode: str, max_tokens: int, out: Path | None
) -> str:
    what = (
        "every turn was an invalid action"
        if s.invalid_rate >= 1.0
        else f"{s.invalid_rate:.0%} of the turns were invalid actions"
    )
    if said:
        what += f' (the env said: "{said if len(said) <= 200 else said[:200] + "..."}")'
    causes = "the reply format the env asks for"
    if s.cut_off_rate > 0:  # (the server said so: finish_reason "length")
        causes += (
            f", {s.cut_off_rate:.0%} of the replies were cut off at --max-tokens {max_tokens} "
            "(raise it)"
        )
    if tools:
        causes += f", or the tools mode (--tools {tools_mode}: try text or native)"
    where = f"envhub view {out} shows" if out is not None else "--out DIR keeps"
    return f"hint: {s.env_id}: {what}; likely causes: {causes}; {where} every transcript"
