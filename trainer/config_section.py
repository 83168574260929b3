"""``Section``: the base of every model in the trainer's config tree (``trainer.config``).

What a section guarantees, and who relies on it:

1. Unknown keys are errors (``extra="forbid"``). The config reader (``trainer._config_io``)
   turns each one into ``unknown key; did you mean ...?`` with the key's dotted path.
2. The docstring under a field is its documentation (``use_attribute_docstrings``): it shows
   in ``model_json_schema()`` and so in every generated reference.
3. Defaults are validated like any other value (``validate_default``): a default that breaks
   a constraint fails the first time the section is built (the config tests build them all).

What a section author writes: one field per setting, each with a docstring below it, and
constraints through ``Field(default=..., gt=0, ...)``. Pass the default by keyword: type
checkers read only ``default=`` (or ``default_factory=``) as the field's default, so a
positional one makes ``SomeConfig()`` look like a call with missing arguments.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["Section"]


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, field docstrings are docs."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)
