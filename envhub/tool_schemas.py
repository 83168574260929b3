"""Tool schemas: ``check_tools`` (are an env's tools well formed?) and the argument validators
``ToolCallParser`` checks every call with.

An env publishes its tools in the OpenAI function format, ``{"type": "function", "function":
{"name", "description", "parameters"}}`` (``envhub.function_tool`` builds one). Those schemas are
rendered into every prompt and decide which calls reach the env's code, so a malformed one is
the env author's bug and is refused once, clearly: ``TextEnv.reset`` and ``ToolCallParser``
call ``validate_tools``, which raises ``ToolSchemaError`` naming every problem. What is checked:

1. the OpenAI shape: each tool is a dict with ``type: "function"`` and a ``function`` dict;
2. ``function.name``: a string of letters, digits, ``_``, ``-`` or ``.``, at most 64
   characters (what chat APIs accept; MCP names may hold dots), unique among the env's tools;
3. ``function.parameters`` (optional): a JSON Schema object with ``"type": "object"`` (a call's
   arguments are always an object) that is valid under its draft's meta-schema (2020-12 unless
   ``$schema`` names another), regular expressions included.

Arguments are then checked by a real JSON Schema validator (``jsonschema``), so every keyword
applies at every depth: nested ``properties``/``required``/``additionalProperties``, ``items``,
``minimum``/``maximum``, ``pattern``, ``oneOf``... One deliberate difference: ``integer`` means
a JSON number written without a fraction (``1``, not ``1.0``), so tool code that receives an
``integer`` gets a Python ``int``. Validators are compiled once per distinct schema and shared.

Why not at ``function_tool``: tool lists are usually built in class bodies, so refusing there
would make the env's whole module fail to import; a check at ``reset`` reaches ``envhub check``
and ``envhub train`` alike, and is cached, so it costs one dictionary lookup per episode.
"""

from __future__ import annotations

import abc
import functools
import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

from envhub.errors import ToolSchemaError

__all__ = [
    "ArgumentsCheck",
    "arguments_validator",
    "check_tools",
    "schema_key",
    "validate_tools",
    "validator_for_key",
]

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_JSON_TYPES = ("string", "integer", "number", "boolean", "object", "array", "null")
_FIX = (
    "build each with envhub.function_tool(name, description, parameters), parameters a JSON "
    "Schema object"
)
_CHECKED: dict[str, tuple[str, ...]] = {}
"""``check_tools``'s answer by the tools' canonical JSON: an env checks its tools every reset."""
_MAX_CHECKED = 1024


def check_tools(tools: Any) -> list[str]:
    """Every problem of ``tools`` (see the module docstring), one line each; empty if none."""
    if not isinstance(tools, (list, tuple)):
        return [f"tools must be a list of tool schemas, got {type(tools).__name__}"]
    problems: list[str] = []
    first_use: dict[str, int] = {}
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(function, dict)
        ):
            problems.append(
                f'{where}: must be {{"type": "function", "function": {{...}}}}, got {tool!r:.80}'
            )
            continue
        name = function.get("name")
        if not isinstance(name, str):
            problems.append(
                f"{where}: function.name is missing"
                if name is None
                else f"{where}: function.name must be a string, got {name!r:.40}"
            )
        else:
            where = f"{where} {name!r:.70}"
            if not _NAME.fullmatch(name):
                problems.append(
                    f"{where}: the name may hold only letters, digits, '_', '-' and '.' (at most "
                    "64), as chat APIs require"
                )
            if name in first_use:
                problems.append(
                    f"{where}: the name {name!r:.70} is used by tools[{first_use[name]}] too; "
                    "names must be unique"
                )
            first_use.setdefault(name, index)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            problems.append(f"{where}.description: must be a string, got {description!r:.40}")
        if "parameters" in function:
            problems += [
                f"{where}.parameters{p}" for p in _parameter_problems(function["parameters"])
            ]
    return problems


def validate_tools(tools: Sequence[Any], owner: str) -> None:
    """Raise ``ToolSchemaError`` naming every problem of ``owner``'s ``tools`` (``check_tools``);
    the answer for the same tools is remembered, so calling it every reset is cheap."""
    try:
        key = json.dumps(tools, sort_keys=True)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ToolSchemaError(
            f"{owner}.tools are not JSON data ({exc}); they are sent to models and over the "
            f"network: {_FIX}"
        ) from None
    problems = _CHECKED.get(key)
    if problems is None:
        problems = tuple(check_tools(tools))
        if len(_CHECKED) >= _MAX_CHECKED:
            _CHECKED.clear()
        _CHECKED[key] = problems
    if problems:
        raise ToolSchemaError(
            f"{owner}.tools has {len(problems)} problem(s) ({_FIX}): " + "; ".join(problems)
        )


def _parameter_problems(parameters: Any) -> list[str]:
    """What is wrong with a tool's ``parameters``, each starting with its path below it."""
    if not isinstance(parameters, dict):
        shape = '{"type": "object", "properties": {...}}'
        return [f": must be a JSON Schema object like {shape}, got {parameters!r:.60}"]
    cls = _validator_class(parameters)
    meta = _meta_validator(cls)
    problems, flagged = [], set()
    for error in sorted(meta.iter_errors(parameters), key=lambda e: list(map(str, e.path))):
        path = _dotted(error.absolute_path)
        flagged.add(path)
        if error.absolute_path and error.absolute_path[-1] == "type":
            message = (
                f"{error.instance!r:.40} is not a JSON type; use one of {', '.join(_JSON_TYPES)}"
            )
        else:
            message = _short(error.message, 160)
        problems.append(f"{'.' + path if path else ''}: {message}")
    if "type" not in flagged and parameters.get("type") != "object":
        problems.append(
            f'.type: must be "object" (a call\'s arguments are a JSON object), got '
            f"{parameters.get('type')!r:.40}"
        )
    return problems


# ---------------------------------------------------------------------- argument checks
class ArgumentsCheck(abc.ABC):
    """A compiled check of call arguments against one tool's ``parameters``.

    ``problem(tool, arguments)`` is ``(message, feedback)`` for the most relevant way the
    arguments break the schema, or ``None`` when they are valid; ``feedback`` is written for the
    model: which argument (``to.x``, ``steps[1]``), what it must be, what it got."""

    @abc.abstractmethod
    def problem(self, tool: str, arguments: dict[str, Any]) -> tuple[str, str] | None: ...


class _SchemaCheck(ArgumentsCheck):
    """Any schema: ``jsonschema``'s validator of its draft, with strict integers."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.validator = _strict_integers(_validator_class(schema))(schema)

    def problem(self, tool: str, arguments: dict[str, Any]) -> tuple[str, str] | None:
        """Raises ``ToolSchemaError`` when the schema itself cannot be applied (a ``$ref`` to
        nothing, or one that refers to itself forever)."""
        from jsonschema.exceptions import best_match
        from referencing.exceptions import Unresolvable

        try:
            if next(self.validator.iter_errors(arguments), None) is None:
                return None
            error = best_match(self.validator.iter_errors(arguments))
        except (Unresolvable, RecursionError) as exc:
            raise ToolSchemaError(
                f"the parameters schema of tool {tool!r} cannot be applied: "
                f"{type(exc).__name__}: {_short(str(exc), 160)}; fix its $ref"
            ) from None
        if error is None:  # cannot happen: iter_errors just yielded one
            return None
        path = _dotted(error.absolute_path)
        message = f"{tool}: {path or 'arguments'}: {_short(error.message, 200)}"
        return message, _feedback(tool, path, error)


_PYTHON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}
_FLAT_KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties"})
_FLAT_PROPERTY_KEYWORDS = frozenset({"type", "enum"})
_ANNOTATIONS = frozenset({"description", "title", "default", "examples"})
"""Keywords that never change whether a value is valid."""


class _FlatCheck(ArgumentsCheck):
    """The common schema, checked without ``jsonschema`` (about 3x faster; a tool env's step
    costs tens of microseconds): top-level ``properties`` whose only constraints are ``type``
    and a scalar ``enum``. ``required`` and ``additionalProperties`` are applied by the parser
    before this check. Verdicts equal ``_SchemaCheck``'s (a test compares them)."""

    def __init__(self, specs: dict[str, tuple[list[str], list[Any] | None]]) -> None:
        self.specs = {
            name: (names, tuple(t for n in names for t in _PYTHON_TYPES[n]), enum)
            for name, (names, enum) in specs.items()
        }

    @staticmethod
    def compile(schema: dict[str, Any]) -> _FlatCheck | None:
        """The flat check of ``schema``, or ``None`` when it uses anything more."""
        if set(schema) - _FLAT_KEYWORDS - _ANNOTATIONS or schema.get("type") != "object":
            return None
        if not isinstance(schema.get("additionalProperties", True), bool):
            return None
        specs = {}
        for name, spec in (schema.get("properties") or {}).items():
            if not isinstance(spec, dict) or set(spec) - _FLAT_PROPERTY_KEYWORDS - _ANNOTATIONS:
                return None
            declared = spec.get("type")
            names = [declared] if isinstance(declared, str) else declared
            enum = spec.get("enum")
            scalars = (str, int, float, bool, type(None))
            if names is None or not isinstance(names, list):
                names = list(_PYTHON_TYPES)  # no type: any JSON value
            if any(n not in _PYTHON_TYPES for n in names) or (
                enum is not None and not all(isinstance(v, scalars) for v in enum)
            ):
                return None
            specs[name] = (names, enum)
        return _FlatCheck(specs)

    def problem(self, tool: str, arguments: dict[str, Any]) -> tuple[str, str] | None:
        for key, value in arguments.items():
            spec = self.specs.get(key)
            if spec is None:
                continue
            names, kinds, enum = spec
            is_bool = isinstance(value, bool)
            if not isinstance(value, kinds) or (is_bool and "boolean" not in names):
                expected = " or ".join(names)
                return (
                    f"{tool}: {key}: {value!r:.60} is not of type {expected}",
                    f"Argument {key!r} of {tool!r} must be of type {expected}, got {value!r:.60}.",
                )
            # JSON Schema's equality: true is not 1 (Python's == says it is), 1 is 1.0
            if enum is not None and not any(
                value == v and is_bool == isinstance(v, bool) for v in enum
            ):
                allowed = f"one of {enum!r:.200}"
                return (
                    f"{tool}: {key}: {value!r:.60} is not {allowed}",
                    f"Argument {key!r} of {tool!r} must be {allowed}, got {value!r:.60}.",
                )
        return None


def schema_key(schema: dict[str, Any]) -> str:
    """The canonical JSON of ``schema``: equal schemas share one compiled check."""
    return json.dumps(schema, sort_keys=True)


def arguments_validator(schema: dict[str, Any]) -> ArgumentsCheck:
    """The compiled check of a tool's ``parameters`` (checked already by ``validate_tools``),
    shared by every equal schema."""
    return validator_for_key(schema_key(schema))


@functools.lru_cache(maxsize=1024)
def validator_for_key(key: str) -> ArgumentsCheck:
    """``arguments_validator`` of the schema whose ``schema_key`` is ``key`` (what a parser
    keeps: a string, cheap to pickle, found again after a pickle in another process)."""
    schema = json.loads(key)  # a copy: a schema mutated later cannot change the cached check
    return _FlatCheck.compile(schema) or _SchemaCheck(schema)


def _feedback(tool: str, path: str, error: Any) -> str:
    subject = f"Argument {path!r} of {tool!r}" if path else f"The arguments of {tool!r}"
    kind, expected, value = error.validator, error.validator_value, error.instance
    if kind == "type":
        names = expected if isinstance(expected, str) else " or ".join(map(str, expected))
        return f"{subject} must be of type {names}, got {value!r:.60}."
    if kind == "enum":
        return f"{subject} must be one of {expected!r:.200}, got {value!r:.60}."
    if kind == "required" and isinstance(value, dict):
        missing = [str(key) for key in expected if key not in value]
        return f"{subject} needs the field(s) {', '.join(missing)}."
    if kind == "additionalProperties" and isinstance(value, dict):
        known = error.schema.get("properties") or {}
        if not error.schema.get("patternProperties"):
            extra = [key for key in value if key not in known]
            return (
                f"{subject} has no field(s) {_short(', '.join(extra), 120)}; it takes "
                f"{', '.join(known) or 'none'}."
            )
    return f"{subject} is invalid: {_short(error.message, 200)}."


# ---------------------------------------------------------------------- jsonschema plumbing
def _validator_class(schema: dict[str, Any]) -> Any:
    """The validator class of ``schema``'s ``$schema`` draft (2020-12 when it names none)."""
    from jsonschema.validators import Draft202012Validator, validator_for

    return validator_for(schema, default=Draft202012Validator)


@functools.cache
def _meta_validator(cls: Any) -> Any:
    """A validator of schemas of draft ``cls`` (its meta-schema, regex formats checked)."""
    return cls(cls.META_SCHEMA, format_checker=cls.FORMAT_CHECKER)


@functools.cache
def _strict_integers(cls: Any) -> Any:
    """``cls`` whose ``integer`` is an ``int`` (JSON Schema lets ``1.0`` be one)."""
    from jsonschema.validators import extend

    def is_integer(_checker: Any, instance: Any) -> bool:
        return isinstance(instance, int) and not isinstance(instance, bool)

    return extend(cls, type_checker=cls.TYPE_CHECKER.redefine("integer", is_integer))


def _dotted(path: Iterable[Any]) -> str:
    """``["to", "x"]`` -> ``"to.x"``, ``["steps", 1]`` -> ``"steps[1]"``."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
