"""The end-of-sequence ids a model's own generation config lists, read once where a model folder
is opened, so that every engine and the trajectory stop on the same tokens.

Chat checkpoints often end a turn with more than the tokenizer's ``eos_token``: Qwen2.5-Instruct
lists ``<|im_end|>`` and ``<|endoftext|>``, Llama-3.x-Instruct ``<|eot_id|>``, ``<|eom_id|>``
and ``<|end_of_text|>`` in ``generation_config.json``. vLLM and ``transformers``' ``generate``
stop on all of them; ``HFEngine`` does too (``HFEngine.from_pretrained``), ``VLLMEngine`` says
so explicitly, and the rollout's ``ChatRenderer`` puts them in every request's
``stop_token_ids`` and counts a turn ending on one as stopped (``turn_end_ids``).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["model_eos_ids"]


def model_eos_ids(folder: str | Path) -> tuple[int, ...]:
    """The ``eos_token_id`` (one id or a list) of ``folder``'s ``generation_config.json``, or of
    its ``config.json`` when it has none (as vLLM reads it); sorted, without repeats. Empty for
    a folder that has neither, or is not a local folder (a tokenizer built in memory)."""
    if not str(folder):  # a tokenizer built in memory has no folder (not ".")
        return ()
    base = Path(folder).expanduser()
    for name in ("generation_config.json", "config.json"):
        file = base / name
        if not file.is_file():
            continue
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return ()
        if name == "config.json":
            config = {**config.get("text_config", {}), **config}
        ids = config.get("eos_token_id")
        ids = [ids] if isinstance(ids, int) else ids if isinstance(ids, list) else []
        return tuple(sorted({int(i) for i in ids if isinstance(i, int) and i >= 0}))
    return ()
