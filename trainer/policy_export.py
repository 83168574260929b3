"""The policy a run exports (``final_policy/``) in ``model.dtype``, not in its fp32 masters.

The roles that train keep fp32 master weights (``workers.strategy_worker.master_dtype``), so a
strategy's ``save_pretrained`` writes fp32 tensors and a ``config.json`` that says
``float32``. A bf16 run's users expect a bf16 folder: half the size, and served in bf16 (vLLM's
``--dtype auto`` serves an fp32 checkpoint in fp16, whose range a bf16-trained model can
overflow). ``in_model_dtype`` rewrites such a folder in place: every floating tensor of its
safetensors files cast to ``model.dtype`` (rounded once, from the masters) and the config's
dtype set to match. A float32 run's folder is left as written.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["in_model_dtype"]

_CONFIG_KEYS = ("torch_dtype", "dtype")
"""Where transformers records a checkpoint's dtype (``dtype`` in newer releases)."""


def in_model_dtype(folder: str | Path, dtype: str) -> None:
    """Cast the HF folder ``folder``'s floating weights to ``dtype`` (``model.dtype``'s name)
    and say so in its ``config.json``; nothing to do for ``float32``."""
    import torch
    from safetensors.torch import load_file, save_file

    if dtype == "float32":
        return
    target = getattr(torch, dtype)
    folder = Path(folder)
    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(file))
        cast = {
            name: t.to(target) if t.is_floating_point() and t.dtype != target else t
            for name, t in tensors.items()
        }
        total += sum(t.numel() * t.element_size() for t in cast.values())
        save_file(cast, str(file), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data.setdefault("metadata", {})["total_size"] = total
        index.write_text(json.dumps(data, indent=2))
    config = folder / "config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        for key in [k for k in _CONFIG_KEYS if k in data] or ["dtype"]:
            data[key] = dtype
        config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
