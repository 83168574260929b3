"""The direct paths ``trainer.rollout.trajectory.ChatRenderer`` renders, encodes and decodes with
where they give ``transformers``' exact output (checked when the renderer is built)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

__all__ = ["FastText"]


class FastText:
    """The direct paths ``ChatRenderer`` uses when they give ``transformers``' exact output.

    ``render`` is the tokenizer's compiled chat template rendered with the variables
    ``apply_chat_template`` passes (the special tokens; messages, tools, no documents);
    ``backend`` is a fast tokenizer's Rust tokenizer, used to encode when it has no truncation
    or padding of its own (``encode`` turns those off) and to decode (``decodes``) when no
    clean-up of spaces applies. Each is checked against the wrapper on probe texts and is
    None / False when it differs or cannot be built (another ``transformers`` version)."""

    _PROBE_TOOLS: ClassVar[list[dict[str, Any]]] = [
        {"type": "function", "function": {"name": "probe", "parameters": {"type": "object"}}}
    ]

    def __init__(self, tokenizer: Any, base: Sequence[dict[str, str]]) -> None:
        self.tokenizer = tokenizer
        self._templates: dict[bool, Any] = {}
        self._variables: dict[str, Any] = {}
        self.backend: Any = None
        self.decodes = False
        try:
            self._build_templates(base)
        except Exception:  # noqa: BLE001 - any failure keeps apply_chat_template
            self._templates = {}
        try:
            self._build_backend(base)
        except Exception:  # noqa: BLE001 - any failure keeps encode/decode
            self.backend, self.decodes = None, False

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        generation_prompt: bool,
        tools: Sequence[dict[str, Any]] | None,
    ) -> str | None:
        template = self._templates.get(bool(tools))
        if template is None:
            return None
        return str(
            template.render(
                messages=list(messages),
                tools=list(tools) if tools else None,
                documents=None,
                add_generation_prompt=generation_prompt,
                **self._variables,
            )
        )

    def _build_templates(self, base: Sequence[dict[str, str]]) -> None:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        self._variables = dict(self.tokenizer.special_tokens_map)
        for with_tools in (False, True):
            tools = self._PROBE_TOOLS if with_tools else None
            source = self.tokenizer.get_chat_template(None, tools)
            self._templates[with_tools] = _compile_jinja_template(source)
            extra = {"tools": tools} if tools else {}
            for prompt in (False, True):
                expected = self.tokenizer.apply_chat_template(
                    list(base), add_generation_prompt=prompt, tokenize=False, **extra
                )
                if self.render(base, prompt, tools) != expected:
                    del self._templates[with_tools]
                    break

    def _build_backend(self, base: Sequence[dict[str, str]]) -> None:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or backend.truncation is not None or backend.padding is not None:
            return
        text = self.tokenizer.apply_chat_template(list(base), tokenize=False) + " x\n  y z!"
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if list(backend.encode(text, add_special_tokens=False).ids) != ids:
            return
        self.backend = backend
        self.decodes = not getattr(self.tokenizer, "clean_up_tokenization_spaces", False) and all(
            backend.decode(ids, skip_special_tokens=skip)
            == self.tokenizer.decode(ids, skip_special_tokens=skip)
            for skip in (True, False)
        )
