"""Reading trainer configs: YAML with line numbers, ``a.b.c=value`` overrides, and turning
pydantic's validation errors into one :class:`~trainer.errors.Problem` per bad value.

Kept apart from ``trainer.config`` so the tree stays readable; ``trainer.config.load_config``
is the public entry point. Overrides apply in order over the file: a dotted key sets one value
(``env.kwargs.size=4`` keeps the file's other kwargs), a mapping value replaces the mapping
whole (``env.kwargs={size: 4}`` sets exactly those, ``env.kwargs={}`` clears them), as any
other value replaces the one in the file; so a mapping in a file can always be emptied from
the command line. Every problem names its dotted path, says what is wrong in plain
words (``unknown key; did you mean group_size?``), shows the bad value, and points at its
origin: ``file.yaml:LINE`` or ``override 'a.b=value'``.

Files and override values are read by one YAML loader, ``SafeLoader`` plus YAML 1.2's floats:
PyYAML follows YAML 1.1, where a float needs a dot, so ``1e-3`` would be the *string*
``'1e-3'``; typed fields convert it anyway, but free-form mappings (``env.kwargs``,
``strategy_args``) would keep the string.
"""

from __future__ import annotations

import difflib
import functools
import re
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from trainer.errors import ConfigError, Problem

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
"""``1e-3``, ``4E1``, ``1.5e3``: floats in YAML 1.2, strings to PyYAML's YAML 1.1 resolver (which
wants a dot and a signed exponent)."""


@functools.cache
def _loader() -> type[Any]:
    """``yaml.SafeLoader`` that also reads exponent numbers without a dot as floats (built once,
    lazily: importing this module does not import yaml)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789."))
    return Loader


# --------------------------------------------------------------------------- YAML


def read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int], list[Problem]]:
    """Parse ``path``: the data, the line of every dotted key, and duplicate-key problems."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            [Problem("", f"config file {str(path)!r} does not exist; check the path")]
        ) from None
    except OSError as err:
        raise ConfigError([Problem("", f"cannot read config file {str(path)!r}: {err}")]) from None
    try:
        node = yaml.compose(text, Loader=_loader())
        data = yaml.load(text, Loader=_loader())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = " ".join(
            str(x) for x in (getattr(err, "context", None), getattr(err, "problem", None)) if x
        )
        raise ConfigError(
            [Problem("", f"broken YAML: {what or err}", where)], source=str(path)
        ) from None
    if data is None:
        return {}, {}, []
    if not isinstance(data, dict):
        raise ConfigError(
            [
                Problem(
                    "",
                    "the top level must be a mapping of sections (model:, env:, ...), "
                    f"not a {type(data).__name__}",
                    str(path),
                )
            ],
            source=str(path),
        )
    lines: dict[str, int] = {}
    problems: list[Problem] = []
    _index_nodes(node, "", lines, problems, path)
    return data, lines, problems


def _index_nodes(
    node: Any, prefix: str, lines: dict[str, int], problems: list[Problem], path: Path
) -> None:
    import yaml

    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            dotted = f"{prefix}.{key}" if prefix else key
            if key in seen:
                problems.append(
                    Problem(
                        dotted,
                        "duplicate key; the later value would silently win, keep one",
                        f"{path}:{key_node.start_mark.line + 1}",
                    )
                )
            seen.add(key)
            lines[dotted] = key_node.start_mark.line + 1
            _index_nodes(value_node, dotted, lines, problems, path)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            dotted = f"{prefix}[{i}]"
            lines[dotted] = item.start_mark.line + 1
            _index_nodes(item, dotted, lines, problems, path)


# --------------------------------------------------------------------------- overrides


def overrides_to_tree(overrides: list[str]) -> tuple[dict[str, Any], list[Problem]]:
    """``["a.b=1"]`` -> ``{"a": {"b": 1}}``; values are parsed as YAML (``[0,1]``, ``null``)."""
    tree, problems, _ = _override_tree(overrides)
    return tree, problems


def _override_tree(
    overrides: list[str],
) -> tuple[dict[str, Any], list[Problem], frozenset[str]]:
    """``overrides_to_tree``, and the dotted keys whose value is a mapping (``a.b={...}``): those
    replace the file's mapping instead of merging into it (see the module docstring)."""
    import yaml

    tree: dict[str, Any] = {}
    problems: list[Problem] = []
    replaced: set[str] = set()
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not _KEY.match(key):
            problems.append(
                Problem(
                    "", f"override {item!r} is not of the form a.b.c=value (dotted keys, then =)"
                )
            )
            continue
        try:
            value = yaml.load(raw, Loader=_loader()) if raw.strip() else None
        except yaml.YAMLError as err:
            problems.append(
                Problem(
                    key,
                    f"cannot parse the value {raw!r} as YAML: {getattr(err, 'problem', err)}",
                    f"override {item!r}",
                )
            )
            continue
        node = tree
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                problems.append(
                    Problem(
                        ".".join(parts[: depth + 1]),
                        f"override {item!r} goes inside a value set by another override",
                    )
                )
                break
            node = child
        else:
            node[parts[-1]] = value
            if isinstance(value, dict):
                replaced.add(key)
    return tree, problems, frozenset(replaced)


def merge(
    base: dict[str, Any],
    over: dict[str, Any],
    prefix: str = "",
    replace: frozenset[str] = frozenset(),
) -> list[Problem]:
    """Merge ``over`` into ``base`` in place: dicts recursively, except at the dotted keys in
    ``replace`` (mapping overrides), which replace ``base``'s value whole like anything else."""
    problems = []
    for key, value in over.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if (
            isinstance(value, dict)
            and dotted not in replace
            and key in base
            and isinstance(base[key], dict)
        ):
            problems += merge(base[key], value, dotted, replace)
        elif (
            isinstance(value, dict)
            and dotted not in replace
            and key in base
            and base[key] is not None
        ):
            problems.append(
                Problem(
                    dotted,
                    f"is {base[key]!r} in the file, not a section; override it whole "
                    f"({dotted}=...) instead of its parts",
                )
            )
        else:
            base[key] = value
    return problems


def _override_sources(overrides: list[str]) -> dict[str, str]:
    return {item.partition("=")[0].strip(): f"override {item!r}" for item in overrides}


# --------------------------------------------------------------------------- loading


def load_validated(cls: type[BaseModel], path: str | Path | None, overrides: list[str]) -> Any:
    """Read, override, validate; raise one ConfigError with every problem found."""
    data: dict[str, Any] = {}
    lines: dict[str, int] = {}
    problems: list[Problem] = []
    source = str(path) if path is not None else None
    if path is not None:
        data, lines, problems = read_yaml(Path(path))
    tree, override_problems, replaced = _override_tree(overrides)
    problems += override_problems
    problems += merge(data, tree, replace=replaced)
    try:
        config = cls.model_validate(data)
    except ValidationError as err:
        problems += validation_problems(err, cls, data)
        config = None
    if problems:
        sources = _override_sources(overrides)
        file_lines = {k: f"{path}:{n}" for k, n in lines.items()}
        raise ConfigError([_locate(p, sources, file_lines) for p in problems], source=source)
    return config


def _locate(problem: Problem, sources: dict[str, str], lines: dict[str, str]) -> Problem:
    """Attach where the value came from: an override of its path, else the overrides below it (a
    section's validator reports at the section's path a value set by ``a.b.c=...``), else the
    longest override or file key that covers its path."""
    if problem.where or not problem.path:
        return problem
    path = problem.path
    below = [where for key, where in sources.items() if key.startswith((f"{path}.", f"{path}["))]
    if path not in sources and below:
        return Problem(problem.path, problem.message, ", ".join(below))
    while path:
        for table in (sources, lines):
            if path in table:
                return Problem(problem.path, problem.message, table[path])
        shorter = re.sub(r"(\.[^.\[]+|\[\d+\])$", "", path) if ("." in path or "[" in path) else ""
        if shorter == path:  # a segment the pattern cannot strip: stop rather than spin
            break
        path = shorter
    return problem


# --------------------------------------------------------------------------- pydantic errors


def validation_problems(err: ValidationError, cls: type[BaseModel], data: Any) -> list[Problem]:
    """One Problem per bad path; union-branch errors at the same path are merged, and a branch
    the value is not (``str`` for a mapping) is dropped when another branch took it further."""
    merged: dict[str, list[str]] = {}
    got: dict[str, str] = {}
    extra: list[Problem] = []
    errors = err.errors(include_url=False)
    for e in errors:
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, ConfigError):  # cross-section checks, already with paths
            extra += cause.problems
            continue
        if _wrong_branch(e, data, [other["loc"] for other in errors]):
            continue
        keep_last = e["type"] == "missing" or _is_field(cls, e["loc"])
        segments = _real_segments(e["loc"], data, keep_last=keep_last)
        dotted = _dotted(segments)
        if e["type"] == "extra_forbidden":
            message = _unknown_key_message(cls, e["loc"])
        else:
            message = e["msg"].removeprefix("Value error, ")
            if (
                e["type"] != "missing"
                and not e["type"].startswith("value_error")
                and _is_scalar(e.get("input"))
            ):
                got[dotted] = f" (got {_short(e['input'])})"
        merged.setdefault(dotted, [])
        if message not in merged[dotted]:
            merged[dotted].append(message)
    return [
        Problem(path, "; or ".join(msgs) + got.get(path, "")) for path, msgs in merged.items()
    ] + extra


def _real_segments(loc: tuple[Any, ...], data: Any, keep_last: bool) -> list[str | int]:
    """Drop pydantic's union-branch tags (``'str'``, ``'list[union[str,EnvEntry]]'``) by walking
    the input: a segment is kept when it is a key or index of the input, or (``keep_last``) when
    it is the last one and names a field the input lacks (a missing key)."""
    out: list[str | int] = []
    node = data
    for i, seg in enumerate(loc):
        in_dict = isinstance(node, dict) and seg in node
        in_list = isinstance(node, list) and isinstance(seg, int) and 0 <= seg < len(node)
        if in_dict or in_list:
            out.append(seg)
            node = node[seg]
        elif keep_last and i == len(loc) - 1 and isinstance(seg, str):
            out.append(seg)
    return out


def _is_field(cls: type[BaseModel], loc: tuple[Any, ...]) -> bool:
    """``loc`` ends in a field of the section it lies in (not in a union-branch tag)."""
    if not loc or not isinstance(loc[-1], str):
        return False
    section = _model_at(cls, loc[:-1])
    return section is not None and loc[-1] in section.model_fields


def _wrong_branch(e: Any, data: Any, locs: list[tuple[Any, ...]]) -> bool:
    """``e`` is a union branch's refusal of the value's shape (its location ends in the branch's
    tag: ``('env', 'id', 'str')``) while a sibling branch's error lies deeper
    (``('env', 'id', 'list[...]', 0, ...)``: the value has that branch's shape and something
    inside it is wrong, which is the one to report)."""
    loc = e["loc"]
    if e["type"] == "missing" or not loc or _real_count(loc, data) > _real_count(loc[:-1], data):
        return False
    branch = len(loc) - 1
    return any(
        len(other) > len(loc) and other[:branch] == loc[:branch] and other[branch] != loc[-1]
        for other in locs
    )


def _real_count(loc: tuple[Any, ...], data: Any) -> int:
    """How many of ``loc``'s segments are keys or indices of the input (not branch tags)."""
    count, node = 0, data
    for seg in loc:
        in_dict = isinstance(node, dict) and seg in node
        in_list = isinstance(node, list) and isinstance(seg, int) and 0 <= seg < len(node)
        if in_dict or in_list:
            count, node = count + 1, node[seg]
    return count


def _dotted(segments: list[str | int]) -> str:
    text = ""
    for seg in segments:
        text += f"[{seg}]" if isinstance(seg, int) else (f".{seg}" if text else str(seg))
    return text


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _model_at(cls: type[BaseModel], loc: tuple[Any, ...] | list[Any]) -> type[BaseModel] | None:
    """The section class that pydantic's location ``loc`` lives in (None if not a section): a
    field name steps into that field, a list index into the list's items, and any other segment
    (a union-branch tag such as ``'list[union[str,EnvEntry]]'``) stays where it is."""
    annotation: Any = cls
    for seg in loc:
        if isinstance(seg, int):
            annotation = _item_annotation(annotation)
            continue
        section = _section_class(annotation, having=seg)
        if section is not None:
            annotation = section.model_fields[seg].annotation
        elif _section_class(annotation) is None and _item_annotation(annotation) is None:
            return None  # below a free-form value (a dict of kwargs): no section
    return _section_class(annotation)


def _item_annotation(annotation: Any) -> Any:
    """The item type of a list in ``annotation`` (a union's list member), or None."""
    if typing.get_origin(annotation) in (list, tuple):
        return (typing.get_args(annotation) or (None,))[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _item_annotation(arg)
            if found is not None:
                return found
    return None


def _section_class(annotation: Any, having: str | None = None) -> type[BaseModel] | None:
    """The section class in ``annotation`` (itself or a union member); with ``having``, the one
    with that field."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation if having is None or having in annotation.model_fields else None
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _section_class(arg, having)
            if found is not None:
                return found
    return None


def _all_fields(cls: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in cls.model_fields.items():
        dotted = f"{prefix}.{name}" if prefix else name
        out.append(dotted)
        sub = _section_class(field.annotation)
        if sub is not None:
            out += _all_fields(sub, dotted)
    return out


def _unknown_key_message(cls: type[BaseModel], loc: tuple[Any, ...]) -> str:
    key = str(loc[-1]) if loc else ""
    section = _model_at(cls, loc[:-1])
    fields = list(section.model_fields) if section is not None else []
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean {close[0]}?"
    elsewhere = [p for p in _all_fields(cls) if p.rsplit(".", 1)[-1] == key]
    if not elsewhere:
        names = {p.rsplit(".", 1)[-1]: p for p in _all_fields(cls)}
        near = difflib.get_close_matches(key, list(names), n=1, cutoff=0.75)
        elsewhere = [names[near[0]]] if near else []
    if elsewhere:
        return f"unknown key; did you mean {elsewhere[0]}?"
    return f"unknown key; valid keys here: {', '.join(fields)}" if fields else "unknown key"
