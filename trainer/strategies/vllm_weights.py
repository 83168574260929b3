"""How ``VLLMEngine.update_weights`` hands full HF-named tensors to vLLM's workers.

vLLM reloads whole layers (fused q/k/v, gate/up), so every update must carry *every* tensor
of the checkpoint the engine was started from (a tied ``lm_head.weight`` is optional).
:class:`CheckpointNames` knows those names and their shapes (read from the safetensors headers,
no tensor data) and checks an update against them (:class:`TensorChecks`, which ``HFEngine``
uses too): a mapping with unknown names (``KeyError``),
missing ones, a tensor of another shape or with NaN/inf values (``ValueError``) is refused
before anything is loaded; an iterator is checked tensor by tensor as it is consumed (before
a tensor reaches vLLM), and once it ran out. vLLM itself would narrow a wider tensor into its
parameter silently, or fail half-way, and NaN weights would be served as NaN log-probs.
Refusing non-finite tensors costs one sum per tensor (:func:`all_finite`), small next to vLLM's
copy.

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
import math
import queue
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.errors import ModelError

__all__ = [
    "CheckpointNames",
    "TensorChecks",
    "all_finite",
    "safetensors_blob",
    "stream_to_engine",
]

_AHEAD = 8
"""Tensors the producer may run ahead of the engine thread."""


def all_finite(tensor: Any) -> bool:
    """Whether ``tensor`` holds no NaN or inf. A sum is finite only if every element is (NaN and
    inf propagate), and it reads the tensor once without the mask ``isfinite`` builds (several
    times faster on CPU); only a sum that overflowed is checked element by element."""
    import torch

    if not tensor.is_floating_point() or math.isfinite(float(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor).all())


class TensorChecks:
    """The checks of tensors an inference model is updated with, before any is loaded: each
    name must be one the model has (``accepted``), each tensor of its shape (``shapes``) and
    finite. ``HFEngine`` checks its updates with these too (``hf_weights``)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], accepted: Iterable[str]) -> None:
        self.shapes = dict(shapes)
        self.accepted = frozenset(accepted)

    def check_known(self, names: Iterable[str]) -> None:
        """``KeyError`` naming the tensors the inference model does not have."""
        unknown = sorted(set(names) - self.accepted)
        if unknown:
            raise KeyError(
                f"update_weights got {unknown[:5]!r}, which the inference model does not have "
                f"(it has {len(self.accepted)} tensors in HF naming, e.g. "
                f"{sorted(self.accepted)[:2]})"
            )

    def check_tensor(self, name: str, tensor: Any) -> None:
        """``ValueError`` when ``tensor`` has another shape than the model's ``name``, or
        NaN/inf values."""

        shape, expected = tuple(tensor.shape), self.shapes.get(name)
        if expected is not None and shape != expected:
            raise ValueError(
                f"update_weights got {name} of shape {shape}; the inference model has "
                f"{expected} ({_likely_cause(name, shape, expected)}); nothing of it was loaded"
            )
        if not all_finite(tensor):
            raise ValueError(
                f"update_weights got {name}, which has non-finite values (NaN or inf): the "
                "training diverged (check the loss and grad_norm of the last steps, lower the "
                "learning rate or resume from an earlier checkpoint)"
            )

    def check_tensors(self, weights: Mapping[str, Any]) -> None:
        """The names and every tensor of a whole update, before anything is loaded."""
        self.check_known(weights.keys())
        for name, tensor in weights.items():
            self.check_tensor(name, tensor)


class CheckpointNames(TensorChecks):
    """The HF tensor names of the checkpoint in ``folder``, and the checks of an update.

    ``required``: what every update must carry; ``accepted``: what it may carry (``required``,
    plus ``lm_head.weight`` for a model with tied embeddings: a trainer's state dict lists
    the tied head too, and vLLM skips it).
    """

    def __init__(self, folder: Path, *, tied_embeddings: bool) -> None:
        shapes = _checkpoint_shapes(folder)
        self.required = frozenset(shapes)
        super().__init__(shapes, self.required | ({"lm_head.weight"} if tied_embeddings else set()))
        if tied_embeddings and "model.embed_tokens.weight" in self.shapes:
            self.shapes.setdefault("lm_head.weight", self.shapes["model.embed_tokens.weight"])

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

    def check_mapping(self, weights: Mapping[str, Any]) -> None:
        """Every check of a whole update, before anything is loaded."""
        self.check_known(weights.keys())
        self.check_complete(weights.keys())
        for name, tensor in weights.items():
            self.check_tensor(name, tensor)

    def checked(
        self, items: Iterator[tuple[str, Any]], *, tensors_checked: bool = False
    ) -> Iterator[tuple[str, Any]]:
        """``items`` with each name and tensor checked as it comes (tensors detached; a mapping
        ``check_mapping`` already checked: ``tensors_checked``), and the whole set checked once
        they ran out."""
        seen: set[str] = set()
        for name, tensor in items:
            self.check_known([name])
            if not tensors_checked:
                self.check_tensor(name, tensor)
            seen.add(name)
            yield name, tensor.detach()
        self.check_complete(seen)


def _likely_cause(name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> str:
    """A guess at why a tensor's shape differs from the checkpoint's, for the error."""
    if ("embed_tokens" in name or "lm_head" in name) and shape[1:] == expected[1:]:
        return (
            "vocabulary resized? start the engine from the resized model's save_pretrained folder"
        )
    if len(shape) == len(expected) and shape == expected[::-1]:
        return "transposed? pass HF-layout tensors (out_features, in_features)"
    if len(shape) == len(expected) and any(
        e % s == 0 and e > s for s, e in zip(shape, expected, strict=True)
    ):
        return "a tensor-parallel shard? gather full tensors before update_weights"
    return "the trainer's model config differs from the engine's model folder?"


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


def _checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """HF tensor names of the checkpoint in ``folder`` and their shapes (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(
            f"{str(folder)!r} has no *.safetensors weights; save the model with save_pretrained"
        )
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes
