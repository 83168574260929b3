"""``Section``: the base of every model in the trainer's config tree (``trainer.config``).

What a section guarantees, and who relies on it:

1. Unknown keys are errors (``extra="forbid"``). The config reader (``trainer._config_io``)
   turns each one into ``unknown key; did you mean ...?`` with the key's dotted path.
2. The docstring under a field is its documentation (``use_attribute_docstrings``): it shows
   in ``model_json_schema()`` and so in every generated reference.
3. Defaults are validated like any other value (``validate_default``): a default that breaks
   a constraint fails the first time the section is built (the config tests build them all).
4. A number is a number: ``true``/``false`` are refused by a number field (pydantic would read
   ``steps: true`` as 1), and ``.inf``/``.nan`` by every field (``allow_inf_nan=False``; an
   unset limit is None, never infinity).

What a section author writes: one field per setting, each with a docstring below it, and
constraints through ``Field(default=..., gt=0, ...)``. Pass the default by keyword: type
checkers read only ``default=`` (or ``default_factory=``) as the field's default, so a
positional one makes ``SomeConfig()`` look like a call with missing arguments.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

__all__ = ["Section"]


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, field docstrings are docs."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_default=True, allow_inf_nan=False
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and _is_a_number(field.annotation):
            raise ValueError(
                f"{str(value).lower()} is a boolean, not a number; give a number (YAML reads "
                "true/false, yes/no and on/off as booleans)"
            )
        return value


def _is_a_number(annotation: Any) -> bool:
    """Whether a field of type ``annotation`` holds a number and no boolean (``int``,
    ``float | None``; not ``bool``, ``EnvEval | bool`` or ``Any``)."""
    options = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else (annotation,)
    )
    return bool({int, float} & set(options)) and bool not in options
