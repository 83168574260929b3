"""``HFEngine``: the embedded ``InferenceEngine``, batched torch generation with a KV cache.

Requests arriving while the event loop is busy are gathered into one batch (the engine
yields to the loop until no new request shows up, so every episode whose turn just ended
joins the same forward pass), left-padded, prefilled once and decoded token by token with
the model's KV cache. Rows stop at EOS, at a request's stop tokens, at their own
``max_new_tokens``, or when aborted. The batch runs in a worker thread so the event loop
keeps stepping envs and scoring rewards meanwhile.

Sampling uses the engine's own ``torch.Generator`` (seeded; saved by ``get_state``), so a
resumed run generates the same tokens as the run it continues. The reported log-prob of a
token is ``log_softmax(logits / temperature)`` at that token (plain ``log_softmax`` when
greedy), which is what the training side recomputes for the PPO ratio.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from trainer.strategies.base import GenerationRequest, GenerationResult, Weights
from trainer.weights.versioned import PolicyVersion, SharedVersion

if TYPE_CHECKING:
    import torch

    from trainer.strategies.lora import AdapterWeights

__all__ = ["BatchingFrontend", "HFEngine"]

RunBatch = Callable[[list[GenerationRequest]], Awaitable[list[GenerationResult]]]


class BatchingFrontend:
    """The async half of an engine: queue requests, gather them into batches, run each batch.

    ``run_batch(requests) -> results`` does the compute (a local torch model in a thread, or
    a call to the ``actor_infer`` cluster); ``generate``/``abort``/``close`` are the
    ``InferenceEngine`` methods every such engine shares.

    ``version`` reads ``policy`` (``trainer.weights.versioned.PolicyVersion``): a front that
    loads weights itself (``HFEngine``) owns one of its own and advances it; a driver-side
    front over the ``actor_infer`` workers should be handed the run's (``WeightSync.policy``)
    and only read it.
    """

    version = SharedVersion()
    """The policy version of the weights this front serves (``policy.value``, read-only)."""

    def __init__(
        self,
        run_batch: RunBatch | None = None,
        *,
        max_batch_size: int = 512,
        policy: PolicyVersion | None = None,
    ) -> None:
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.policy = policy if policy is not None else PolicyVersion()
        self._queue: list[tuple[GenerationRequest, asyncio.Future[GenerationResult]]] = []
        self._aborted: set[str] = set()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    async def run_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if self._run_batch is None:
            raise NotImplementedError(f"{type(self).__name__} needs run_batch")
        return await self._run_batch(requests)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        loop = asyncio.get_running_loop()
        if (
            self._wake is None
            or self._task is None
            or self._task.done()
            or self._task.get_loop() is not loop
        ):
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._serve(self._wake))
        future: asyncio.Future[GenerationResult] = loop.create_future()
        self._queue.append((request, future))
        self._wake.set()
        return await future

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)
        for request, future in list(self._queue):
            if request.request_id == request_id and not future.done():
                self._queue.remove((request, future))
                future.set_result(GenerationResult(request_id, [], [], "abort", self.version))

    async def close(self) -> None:
        """Stop the batching task (pending requests are aborted)."""
        for request, future in self._queue:
            if not future.done():
                future.set_result(
                    GenerationResult(request.request_id, [], [], "abort", self.version)
                )
        self._queue.clear()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, RuntimeError):
                pass
            self._task = None

    # ------------------------------------------------------------------ batching
    async def _serve(self, wake: asyncio.Event) -> None:
        while True:
            await wake.wait()
            wake.clear()
            seen = -1
            while seen != len(self._queue):  # let every runnable episode enqueue its turn
                seen = len(self._queue)
                for _ in range(4):
                    await asyncio.sleep(0)
            batch, self._queue = (
                self._queue[: self.max_batch_size],
                self._queue[self.max_batch_size :],
            )
            batch = [(r, f) for r, f in batch if not f.done()]
            if batch:
                try:
                    results = await self.run_batch([r for r, _ in batch])
                except Exception as error:  # noqa: BLE001 - handed to every waiting future
                    # whatever failed the batch reaches every waiter, who re-raises it, instead
                    # of leaving them hanging; it may be of any type
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(error)
                    results = []
                for (_, future), result in zip(batch, results, strict=False):
                    if not future.done():
                        future.set_result(result)
                self._aborted -= {r.request_id for r, _ in batch}
            if self._queue:
                wake.set()


class HFEngine(BatchingFrontend):
    """Torch generation for any ``AutoModelForCausalLM`` (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        *,
        eos_token_id: int,
        pad_token_id: int,
        seed: int = 0,
        max_batch_size: int = 512,
        device: str = "cpu",
    ) -> None:
        import torch

        super().__init__(max_batch_size=max_batch_size)
        self.model = model.to(device).eval()
        self.device = device
        self.eos_token_id, self.pad_token_id = int(eos_token_id), int(pad_token_id)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self._params: dict[str, torch.Tensor] | None = None
        self.stats = {"batches": 0, "requests": 0, "new_tokens": 0}

    @classmethod
    def from_pretrained(
        cls,
        model_path: str,
        *,
        dtype: str = "float32",
        seed: int = 0,
        lora_rank: int | None = None,
        **options: Any,
    ) -> HFEngine:
        """The registry's ``hf`` engine: the policy at ``model_path``, on CUDA when visible
        (``lora_rank``: adapters will come; this engine needs nothing ahead of them)."""
        if options:
            raise ValueError(
                f"strategy_args {sorted(options)} are not options of the 'hf' inference engine "
                "(it has none)"
            )
        import torch

        from trainer.models import load_policy

        model, tokenizer = load_policy(model_path, dtype=dtype)
        return cls(
            model,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            seed=seed,
            device="cuda" if torch.cuda.is_available() else "cpu",
        )

    async def run_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        return await asyncio.to_thread(self.generate_batch, requests)

    def update_weights(self, weights: Weights) -> None:
        import torch

        if self._params is None:
            self._params = dict(self.model.state_dict(keep_vars=True))
        items = weights.items() if isinstance(weights, Mapping) else weights
        with torch.no_grad():
            for name, tensor in items:
                target = self._params.get(name)
                if target is None:
                    raise KeyError(
                        f"update_weights got {name!r}, which the inference model does not have"
                    )
                target.copy_(tensor.to(target.device, target.dtype))
        self.policy.advance()

    def load_adapter(self, adapter: AdapterWeights) -> None:
        """Serve the base weights with ``adapter`` (LoRA): the first call wraps the model with the
        adapter's ``peft`` config, every call loads its tensors; bumps the version. Base syncs
        (``update_weights``) keep reaching the base weights."""
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        from trainer.strategies.lora import ADAPTER

        if self._params is None:  # the base's own names, before peft renames its layers
            self._params = dict(self.model.state_dict(keep_vars=True))
        if not hasattr(self.model, "peft_config"):
            known = set(LoraConfig.__dataclass_fields__)
            config = LoraConfig(**{k: v for k, v in adapter.config.items() if k in known})
            with warnings.catch_warnings():  # a tied embedding's adapter: see lora.apply_lora
                warnings.filterwarnings("ignore", message=".*ensure_weight_tying.*")
                self.model = get_peft_model(self.model, config, adapter_name=ADAPTER).eval()
        result: Any = set_peft_model_state_dict(self.model, adapter.tensors, adapter_name=ADAPTER)
        unexpected = [k for k in result.unexpected_keys if "lora_" in k]
        if unexpected:
            raise KeyError(f"load_adapter got tensors the model has no place for: {unexpected[:3]}")
        self.policy.advance()

    def sleep(self) -> None:
        """Nothing to release for a torch model that stays where it is."""

    def wake_up(self) -> None:
        """See ``sleep``."""

    def get_state(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "version": self.version}

    def set_state(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.policy.restore(int(state.get("version", self.version)))

    # ------------------------------------------------------------------ compute
    def generate_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Generate for ``requests`` as one padded batch (synchronous; also usable directly)."""
        import torch

        rows = len(requests)
        lengths = [len(r.prompt_ids) for r in requests]
        if min(lengths) == 0:
            raise ValueError(
                "a generation request has no prompt tokens; render the chat template first"
            )
        width = max(lengths)
        input_ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((rows, width), dtype=torch.long)
        for i, request in enumerate(requests):  # left padding: prompts end at the same column
            input_ids[i, width - lengths[i] :] = torch.tensor(request.prompt_ids, dtype=torch.long)
            attention[i, width - lengths[i] :] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        temperature = torch.tensor([r.temperature for r in requests], dtype=torch.float32)
        top_p = torch.tensor([r.top_p for r in requests], dtype=torch.float32)
        limits = torch.tensor([r.max_new_tokens for r in requests])
        stops = [{self.eos_token_id, *r.stop_token_ids} for r in requests]
        new_ids: list[list[int]] = [[] for _ in requests]
        new_logprobs: list[list[float]] = [[] for _ in requests]
        reasons: list[str] = ["length"] * rows
        done = torch.zeros(rows, dtype=torch.bool)
        with torch.inference_mode():
            out = self.model(
                input_ids=input_ids.to(self.device),
                attention_mask=attention.to(self.device),
                position_ids=positions.to(self.device),
                use_cache=True,
                logits_to_keep=1,  # only the next token's: not rows x prompt x vocabulary
            )
            past, next_pos = out.past_key_values, positions[:, -1] + 1
            for step in range(int(limits.max())):
                tokens, logprobs = self._sample(out.logits[:, -1].float().cpu(), temperature, top_p)
                for i in range(rows):
                    if done[i]:
                        continue
                    token = int(tokens[i])
                    new_ids[i].append(token)
                    new_logprobs[i].append(float(logprobs[i]))
                    if token in stops[i]:
                        done[i], reasons[i] = True, "stop"
                    elif requests[i].request_id in self._aborted:
                        done[i], reasons[i] = True, "abort"
                    elif step + 1 >= limits[i]:
                        done[i] = True
                if bool(done.all()):
                    break
                tokens = torch.where(done, torch.full_like(tokens, self.pad_token_id), tokens)
                attention = torch.cat([attention, (~done).long()[:, None]], dim=1)
                out = self.model(
                    input_ids=tokens[:, None].to(self.device),
                    attention_mask=attention.to(self.device),
                    position_ids=next_pos[:, None].to(self.device),
                    past_key_values=past,
                    use_cache=True,
                )
                past, next_pos = out.past_key_values, next_pos + 1
        self.stats["batches"] += 1
        self.stats["requests"] += rows
        self.stats["new_tokens"] += sum(len(ids) for ids in new_ids)
        return [
            GenerationResult(r.request_id, new_ids[i], new_logprobs[i], reasons[i], self.version)  # type: ignore[arg-type]
            for i, r in enumerate(requests)
        ]

    def _sample(
        self, logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: greedy when temperature is 0, else nucleus sampling from ``softmax(z / T)``."""
        import torch

        greedy = temperature <= 0
        scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
        logprobs = torch.log_softmax(scaled, dim=-1)
        probs = logprobs.exp()
        if bool((top_p < 1).any()):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            keep = (sorted_probs.cumsum(-1) - sorted_probs) < top_p[:, None]
            filtered = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
            probs = filtered / filtered.sum(-1, keepdim=True)
        if bool(greedy.all()):  # evaluation: no sampling, and the RNG is left untouched
            tokens = logits.argmax(-1)
        else:
            sampled = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
            tokens = torch.where(greedy, logits.argmax(-1), sampled)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
