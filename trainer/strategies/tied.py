"""Tied parameters (``lm_head.weight`` sharing the input embedding) in a strategy's weights.

A model with ``tie_word_embeddings`` lists one parameter under two names in its
``state_dict``. The weight sync must deliver both names (vLLM on CPU rebuilds its LM head's
packed kernel only when ``lm_head.weight`` arrives) but should move the bytes once: on the
gathered and broadcast paths the second name used to cost a second all-gather (FSDP2) and a
second copy in the bucket, ~27% more bytes for Qwen2.5-0.5B.

:func:`full_state` yields each tied parameter once, under its first name, followed at once by
its other names carrying *the same tensor object*; ``trainer.weights.buckets`` stores a
tensor it has already packed in a bucket once, as a second name for the same bytes. The
shard-direct path (``trainer.weights.shards``) reads :func:`tied_names` for its aliases.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["full_state", "tied_names"]


def tied_names(model: Any) -> dict[str, list[str]]:
    """``{first name: [its other names]}`` for every parameter listed under several names.

    Found on the parameters themselves (``named_parameters(remove_duplicate=False)``): a
    sharded ``state_dict`` may hand out a new wrapper per name for one parameter.
    """
    first: dict[int, str] = {}
    tied: dict[str, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied.setdefault(first[id(param)], []).append(name)
        else:
            first[id(param)] = name
    return tied


def full_state(
    model: Any, full: Callable[[Any], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``model.state_dict()`` as ``(name, full(tensor))``, in order, each tied parameter made
    full once: its other names follow its first at once, with the same tensor object."""
    tied = tied_names(model)
    later = {alias for aliases in tied.values() for alias in aliases}
    for name, tensor in model.state_dict().items():
        if name in later:
            continue
        whole = full(tensor)
        yield name, whole
        for alias in tied.get(name, ()):
            yield alias, whole
