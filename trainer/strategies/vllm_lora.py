"""The LoRA adapters a ``VLLMEngine`` built with ``lora_rank`` serves (``load_adapter``).

Each ``load_adapter`` writes the adapter as a ``peft`` folder and registers it with vLLM under
an id of its own; new requests are served with the latest one. A request keeps the adapter it
started with until it finishes: vLLM reloads an adapter from its folder whenever it was evicted
(or preempted requests are rescheduled), so an adapter and its folder are removed only once no
request holds it (a count per adapter). Requests running across an adapter swap therefore finish
on their adapter, not the new one (unlike a base-weight reload, which moves every running
request to the new weights): their ``policy_version`` stays right, with no ``final_version``.
vLLM keys its prefix cache by the adapter's name and folder, so the new adapter never reuses
KV computed under another one and no prefix-cache reset is needed.

``MAX_LORAS`` adapters can run in one engine step; requests of a further adapter wait in vLLM's
queue until one of them has no running request left (they are not refused).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.errors import ModelError

if TYPE_CHECKING:
    from trainer.strategies.lora import AdapterWeights

__all__ = ["MAX_LORAS", "AdapterSlots"]

_log = logging.getLogger(__name__)

MAX_LORAS = 4
"""vLLM's ``max_loras``: the latest adapter and up to three older ones that requests started
under still finishing (a sync every step with requests lasting up to three syncs)."""


class AdapterSlots:
    """The adapters one engine holds: the latest (``current``) and those requests still use."""

    def __init__(self, enabled: bool) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="envhub-lora-")) if enabled else None
        self.ids = 0
        self.current: Any = None
        """The ``LoRARequest`` new requests are served with, or None (base weights)."""
        self._users: dict[int, int] = {}  # adapter id -> requests holding it

    def prepare(self, adapter: AdapterWeights, model_path: str) -> Any:
        """Write ``adapter`` to a folder of its own (caller's thread); its ``LoRARequest``."""
        from vllm.lora.request import LoRARequest

        from trainer.strategies.lora import write_adapter
        from trainer.strategies.vllm_weights import all_finite

        if self.folder is None:
            raise ModelError(
                "this vLLM engine was built without LoRA; build it with lora_rank (model.lora "
                "with sync: adapter does) or sync merged weights (model.lora.sync: merged)"
            )
        for name, tensor in adapter.tensors.items():
            if not all_finite(tensor):
                raise ValueError(
                    f"load_adapter got {name}, which has non-finite values (NaN or inf): the "
                    "training diverged; the engine keeps serving the previous adapter"
                )
        self.ids += 1
        folder = write_adapter(self.folder / f"v{self.ids}", adapter, model_path)
        return LoRARequest(f"envhub-v{self.ids}", self.ids, str(folder))

    def swap(self, llm: Any, request: Any) -> None:
        """Serve new requests with ``request`` (engine thread); drop the previous adapter now
        if no request holds it."""
        if not llm.add_lora(request):
            raise RuntimeError(f"vLLM refused the LoRA adapter {request.lora_path}")
        old, self.current = self.current, request
        if old is not None and not self._users.get(old.lora_int_id):
            self._drop(llm, old)

    def acquire(self) -> Any:
        """The adapter for a request being added (engine thread); ``release`` it when done."""
        if self.current is not None:
            lora_id = self.current.lora_int_id
            self._users[lora_id] = self._users.get(lora_id, 0) + 1
        return self.current

    def release(self, llm: Any, request: Any) -> None:
        """A request holding ``request`` finished (engine thread)."""
        if request is None:
            return
        left = self._users.get(request.lora_int_id, 1) - 1
        if left > 0:
            self._users[request.lora_int_id] = left
            return
        self._users.pop(request.lora_int_id, None)
        if request is not self.current:
            self._drop(llm, request)

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _drop(self, llm: Any, request: Any) -> None:
        try:
            llm.remove_lora(request.lora_int_id)
        except Exception:  # noqa: BLE001 - a failed engine: its folder goes all the same
            _log.warning("vLLM failed to remove LoRA adapter %s", request.lora_name, exc_info=True)
        shutil.rmtree(request.lora_path, ignore_errors=True)
