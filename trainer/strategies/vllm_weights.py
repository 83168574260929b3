"""How ``VLLMEngine.update_weights`` hands full HF-named tensors to vLLM's workers.

vLLM reloads whole layers (fused q/k/v, gate/up), so every update must carry *every* tensor
of the checkpoint the engine was started from (a tied ``lm_head.weight`` is optional).
:class:`CheckpointNames` knows those names and checks an update against them: a mapping
with unknown names (``KeyError``) or missing ones (``ValueError``) is refused before anything
is loaded; an iterator is checked tensor by tensor as it is consumed, and once it ran out.

Two ways the tensors travel, chosen by the engine:

* In process (one rank): :func:`stream_to_engine` feeds them through a small bounded queue
  from the caller's thread to the engine thread, which passes them on to vLLM's
  ``reload_weights`` as they come - no copy besides vLLM's own, and a bucketed gather never
  holds the whole model twice. A failure on either side ends both: the producer's error
  reaches the reload (the engine then refuses to generate) and is raised to the caller.
* Worker processes (tensor parallel, or ``VLLM_ENABLE_V1_MULTIPROCESSING=1``):
  :func:`safetensors_blob` packs one update into one safetensors blob, since tensors sent
  through ``collective_rpc`` would arrive as nested lists.

What the workers do with them is ``vllm_worker.EnvhubWorkerExtension``.
"""

from __future__ import annotations

import concurrent.futures
import queue
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.errors import ModelError

__all__ = ["CheckpointNames", "safetensors_blob", "stream_to_engine"]

_AHEAD = 8
"""Tensors the producer may run ahead of the engine thread."""


class CheckpointNames:
    """The HF tensor names of the checkpoint in ``folder``, and the checks of an update.

    ``required``: what every update must carry; ``accepted``: what it may carry (``required``,
    plus ``lm_head.weight`` for a model with tied embeddings: a trainer's state dict lists
    the tied head too, and vLLM skips it).
    """

    def __init__(self, folder: Path, *, tied_embeddings: bool) -> None:
        self.required = frozenset(_checkpoint_names(folder))
        self.accepted = self.required | ({"lm_head.weight"} if tied_embeddings else set())

    def check_known(self, names: Iterable[str]) -> None:
        """``KeyError`` naming the tensors the inference model does not have."""
        unknown = sorted(set(names) - self.accepted)
        if unknown:
            raise KeyError(
                f"update_weights got {unknown[:5]!r}, which the inference model does not have "
                f"(it has {len(self.accepted)} tensors in HF naming, e.g. "
                f"{sorted(self.accepted)[:2]})"
            )

    def check_complete(self, names: Iterable[str]) -> None:
        """``ValueError`` when ``names`` lack a tensor of the checkpoint."""
        missing = sorted(self.required - set(names))
        if missing:
            raise ValueError(
                f"update_weights got {len(self.required) - len(missing)} of the model's "
                f"{len(self.required)} tensors (missing e.g. {missing[:3]}); vLLM reloads whole "
                "layers, so every update must carry the full set of HF-named tensors (buckets of "
                "one call's iterator are fine)"
            )

    def checked(self, items: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """``items`` with each name checked as it comes (tensors detached), and the whole set
        checked once they ran out."""
        seen: set[str] = set()
        for name, tensor in items:
            self.check_known([name])
            seen.add(name)
            yield name, tensor.detach()
        self.check_complete(seen)


def safetensors_blob(items: Iterable[tuple[str, Any]]) -> bytes:
    """One update as a safetensors blob (CPU, contiguous) for worker processes."""
    from safetensors.torch import save

    return save({name: tensor.detach().to("cpu").contiguous() for name, tensor in items})


def stream_to_engine(
    items: Iterable[tuple[str, Any]],
    start: Callable[[Iterator[tuple[str, Any]]], concurrent.futures.Future[Any]],
) -> None:
    """Feed ``items`` from this thread to a consumer on the engine thread; returns when it is done.

    ``start(stream)`` schedules the consumer (the engine's reload, reading ``stream``) and
    returns its future. The producer never blocks forever on a consumer that failed: it stops
    and the future's error is raised. A failure while producing is handed to the consumer as
    an error in its stream, and re-raised here once the consumer finished.
    """
    channel: queue.Queue[Any] = queue.Queue(maxsize=_AHEAD)
    future = start(_drain(channel))
    try:
        for item in items:
            _put_until_done(channel, item, future)
            if future.done():  # the engine side failed: its future says why
                break
    except BaseException as error:
        _put_until_done(channel, _Failure(error), future)
        concurrent.futures.wait([future])  # the engine side marks itself broken first
        raise
    _put_until_done(channel, _End(), future)
    future.result()


class _End:
    """Message: the producer is done."""


@dataclass
class _Failure:
    """Message: the producer failed with ``error``."""

    error: BaseException


def _drain(channel: queue.Queue[Any]) -> Iterator[tuple[str, Any]]:
    """The engine-thread end of the stream: tensors until the producer is done or failed."""
    while True:
        match channel.get():
            case _End():
                return
            case _Failure(error=error):
                raise RuntimeError(f"the weights iterator failed: {error!r}") from error
            case item:
                yield item


def _put_until_done(
    channel: queue.Queue[Any], item: Any, future: concurrent.futures.Future[Any]
) -> None:
    """Put ``item``, waiting for room, unless the consumer's ``future`` is done first."""
    while not future.done():
        try:
            channel.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


def _checkpoint_names(folder: Path) -> set[str]:
    """HF tensor names of the checkpoint in ``folder``."""
    from safetensors import safe_open

    names: set[str] = set()
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(
            f"{str(folder)!r} has no *.safetensors weights; save the model with save_pretrained"
        )
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            names.update(handle.keys())
    return names
