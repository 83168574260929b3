"""The vLLM worker extension ``VLLMEngine`` installs: in-place weight reloads on every worker.

vLLM mixes ``worker_extension_cls`` into each of its workers (the in-process worker on CPU,
one process per tensor-parallel rank on GPUs) and ``collective_rpc(name, ...)`` calls a
method of it on all of them; this module must therefore be importable by the workers, and
import nothing heavy itself.

Why ``reload_weights`` and not ``model.load_weights``: on CPU vLLM repacks linear layers into
kernel layouts after loading, and a second ``load_weights`` into the repacked layers fails;
``model_runner.reload_weights`` restores the checkpoint layout layer by layer, loads the new
tensors and repacks again. The method is not called ``update_weights`` because vLLM's
worker already has a method of that name (its own weight-transfer API).

A reload that raises inside vLLM (its loader refusing a tensor) would leave layers half-way
between the checkpoint and the kernel layout, and every later reload would fail with the same
error: the extension then finishes vLLM's layer-wise reload itself (the layers go back to the
kernel layout, holding a mix of old and new weights) before re-raising, so the next full
update loads cleanly.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

__all__ = ["EnvhubWorkerExtension"]

_log = logging.getLogger(__name__)


class EnvhubWorkerExtension:
    """Methods ``collective_rpc`` runs on each vLLM worker (``self`` is the worker)."""

    model_runner: Any

    def envhub_reload_weights(
        self,
        weights: Iterable[tuple[str, Any]] | None = None,
        safetensors_bytes: bytes | None = None,
        path: str | None = None,
    ) -> int:
        """Load full HF-named tensors in place; returns how many tensors were given.

        ``weights`` (an iterable of ``(name, tensor)``) works only in-process, where the
        object is handed over as is; across processes pass ``safetensors_bytes`` (tensors
        sent through ``collective_rpc`` would arrive as nested lists) or a ``path`` to a
        folder of ``*.safetensors`` files.
        """
        count = 0
        failure: BaseException | None = None

        tied = bool(getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False))

        def guarded(items: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
            # A source that fails part-way ends the stream cleanly instead of raising inside
            # vLLM: the reload then still restores every layer to its kernel layout (a raise
            # would leave layers mid-reload, and every later reload would fail too). The
            # weights are then a mix, so the error is re-raised and the caller must resync.
            nonlocal count, failure
            embedding, head = None, False
            try:
                for name, tensor in items:
                    count += 1
                    if name == "model.embed_tokens.weight":
                        embedding = tensor
                    head = head or name == "lm_head.weight"
                    yield name, tensor
            except Exception as error:  # noqa: BLE001 - re-raised after the reload finished
                failure = error
                return
            if tied and embedding is not None and not head:
                # vLLM on CPU repacks the tied LM head only when lm_head.weight itself arrives;
                # without it the head keeps serving the previous embedding
                yield "lm_head.weight", embedding

        if safetensors_bytes is not None:
            from safetensors.torch import load

            weights = load(safetensors_bytes).items()
        try:
            if weights is not None:
                self.model_runner.reload_weights(weights_iterator=guarded(weights))
            elif path is not None:
                self.model_runner.reload_weights(weights_path=path)
                count = -1
            else:
                raise ValueError("envhub_reload_weights needs weights, safetensors_bytes or path")
        except Exception:
            try:
                self._finish_failed_reload()
            except Exception:  # noqa: BLE001 - the loader's error below says what failed
                _log.warning("could not finish vLLM's failed reload", exc_info=True)
            raise
        if failure is not None:
            raise failure
        return count

    def _finish_failed_reload(self) -> None:
        """Finish vLLM's layer-wise reload after its loader raised (see the module docstring)."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        runner = self.model_runner
        finalize_layerwise_reload(runner.get_model(), runner.model_config)
