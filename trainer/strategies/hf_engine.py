"""``HFEngine``: the embedded ``InferenceEngine``, continuous batching of torch generation with
a KV cache.

Requests arriving while the event loop is busy are gathered (the front yields to the loop
until no new request shows up, so every episode whose turn just ended comes together) and
handed to the engine's decoding thread, which admits them between two decoding steps: their
prompts are prefilled as left-padded batches of similar length and their KV caches joined to
the running rows'. Every step then decodes one token for every running row; a row leaves the
batch (and its cache) as soon as it ends, at EOS, at a request's stop tokens, at its own
``max_new_tokens``, or when aborted, so no step computes a finished row and a short turn
never waits for a long one. The event loop keeps stepping envs and scoring rewards
meanwhile. Threads without a loop use ``submit``; ``generate_batch`` runs one batch to the
end in the caller's thread.

Sampling happens on the model's device: one uniform per row and step comes from the
engine's own CPU ``torch.Generator`` (seeded; saved by ``get_state``) and is inverted through
the row's cumulative distribution, so only the sampled ids and their log-probs leave the
device and the random stream is the same whatever the device (a resumed run, given the same
batches, generates what the run it continues did). The reported log-prob of a token is
``log_softmax(logits / temperature)`` at that token (plain ``log_softmax`` when greedy),
which is what the training side recomputes for the PPO ratio. A weight update waits for
the running step and applies to the steps after it (a row's ``policy_version`` is the one
it started under, like vLLM's).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import warnings
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from trainer.strategies.base import FinishReason, GenerationRequest, GenerationResult, Weights
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
                await self._dispatch(batch)
            if self._queue:
                wake.set()

    async def _dispatch(
        self, batch: list[tuple[GenerationRequest, asyncio.Future[GenerationResult]]]
    ) -> None:
        """Run one gathered batch and answer its futures (an engine that admits requests into
        a running batch overrides this to hand them over and return at once)."""
        try:
            results = await self.run_batch([r for r, _ in batch])
        except Exception as error:  # noqa: BLE001 - handed to every waiting future
            _fail_all(batch, error)
            results = []
        for (_, future), result in zip(batch, results, strict=False):
            if not future.done():
                future.set_result(result)
        self._aborted -= {r.request_id for r, _ in batch}


def _fail_all(
    batch: list[tuple[GenerationRequest, asyncio.Future[GenerationResult]]], error: BaseException
) -> None:
    """Whatever failed a batch reaches every waiter, who re-raises it, instead of leaving them
    hanging; it may be of any type."""
    for _, future in batch:
        if not future.done():
            future.set_exception(error)


class HFEngine(BatchingFrontend):
    """Torch generation for any ``AutoModelForCausalLM`` (see the module docstring)."""

    prefill_group_tokens = 2048
    """Prompts admitted together are prefilled in groups of similar length; a group smaller
    than this many padded tokens takes any prompt rather than start another forward pass."""

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
        self._compute = threading.Lock()  # one forward at a time; weight updates between them
        self._admit = threading.Condition()  # guards _waiting, _thread, _closed
        self._waiting: list[_Row] = []
        self._live: set[str] = set()  # ids submitted and not yet answered
        self._thread: threading.Thread | None = None
        self._closed = False

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
        return list(await asyncio.gather(*map(asyncio.wrap_future, self.submit_many(requests))))

    async def _dispatch(
        self, batch: list[tuple[GenerationRequest, asyncio.Future[GenerationResult]]]
    ) -> None:
        """Hand the gathered requests to the decoding thread and return: they join the running
        rows at its next step, and each future is answered when its own row ends."""
        loop = asyncio.get_running_loop()
        try:
            submitted = self.submit_many([r for r, _ in batch])
        except Exception as error:  # noqa: BLE001 - handed to every waiting future
            _fail_all(batch, error)
            return
        for (_, future), done in zip(batch, submitted, strict=True):
            done.add_done_callback(_answer_in(loop, future))

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        """Queue ``request`` for admission at the next step and return at once (for threads)."""
        return self.submit_many([request])[0]

    def submit_many(
        self, requests: list[GenerationRequest]
    ) -> list[concurrent.futures.Future[GenerationResult]]:
        """``submit`` for several requests that are admitted together (one prefill)."""
        _check_prompts(requests)
        rows = [_Row(r, self.eos_token_id, concurrent.futures.Future()) for r in requests]
        with self._admit:
            if self._closed:
                raise RuntimeError("this HFEngine was shut down")
            self._waiting.extend(rows)
            self._live.update(r.request_id for r in requests)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._decode_loop, name="hf-engine-decode", daemon=True
                )
                self._thread.start()
            self._admit.notify()
        return [row.future for row in rows]  # type: ignore[misc]

    def abort_sync(self, request_ids: list[str]) -> None:
        """``abort`` for threads: a waiting request ends with no tokens, a running one at its
        next token (``finish_reason="abort"`` either way); ids this engine does not hold (ended,
        or never submitted) are ignored."""
        with self._admit:
            self._aborted.update(rid for rid in request_ids if rid in self._live)
            self._admit.notify()

    async def abort(self, request_id: str) -> None:
        await super().abort(request_id)
        self.abort_sync([request_id])

    def shutdown(self) -> None:
        """Stop the decoding thread; whatever it still holds ends with ``abort``."""
        with self._admit:
            self._closed = True
            thread, self._thread = self._thread, None
            self._admit.notify()
        if thread is not None:
            thread.join()

    def update_weights(self, weights: Weights) -> None:
        import torch

        if self._params is None:
            self._params = dict(self.model.state_dict(keep_vars=True))
        items = weights.items() if isinstance(weights, Mapping) else weights
        with torch.no_grad(), self._compute:
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
        with self._compute:
            self._load_adapter(adapter)
        self.policy.advance()

    def _load_adapter(self, adapter: AdapterWeights) -> None:
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
        """Generate for ``requests`` as one batch, to the end (synchronous, in this thread)."""
        rows = [_Row(r, self.eos_token_id) for r in requests]
        batch, _ = self._prefill(rows)
        while batch.rows:
            self._step(batch)
        return [row.result() for row in rows]

    def _decode_loop(self) -> None:
        """The decoding thread: admit waiting rows between steps, step the running ones, answer
        each row's future as it ends; exits on ``shutdown`` (what it holds ends ``abort``)."""
        running: _Batch | None = None
        while True:
            with self._admit:
                while not self._closed and not self._waiting and running is None:
                    self._admit.wait()
                if self._closed:
                    left = self._waiting + (running.rows if running is not None else [])
                    self._waiting = []
                    for row in left:
                        row.end("abort")
                    self._live.clear()
                    return
                room = self.max_batch_size - (len(running.rows) if running is not None else 0)
                if running is not None and not running.can_join:
                    room = 0  # a cache this engine cannot join rows into: admit when it is empty
                room = max(room, 0)
                new, self._waiting = self._waiting[:room], self._waiting[room:]
            ended = [row.end("abort") for row in new if row.request.request_id in self._aborted]
            new = [row for row in new if row.reason is None]
            try:
                if new:
                    fresh, gone = self._prefill(new)
                    ended += gone
                    if fresh.rows:
                        running = fresh if running is None else running.join(fresh)
                new = []
                if running is not None:
                    ended += self._step(running)
                    if not running.rows:
                        running = None
            except Exception as error:  # noqa: BLE001 - handed to the rows it stopped
                failed = new or (running.rows if running is not None else [])
                for row in failed:
                    row.fail(error)
                ended += failed
                if not new:
                    running = None
            with self._admit:
                for row in ended:
                    row.answer()
                    self._live.discard(row.request.request_id)
                    self._aborted.discard(row.request.request_id)

    def _prefill(self, rows: list[_Row]) -> tuple[_Batch, list[_Row]]:
        """Prefill the prompts of ``rows`` and sample each row's first token: the rows that go
        on (one batch, with their KV cache), and those that ended already. Prompts of very
        different lengths are prefilled in groups of similar length (``_length_groups``), so
        a short prompt is not padded to the longest one's width; the groups are joined."""
        _check_prompts([row.request for row in rows])
        lengths = [len(row.request.prompt_ids) for row in rows]
        groups = _length_groups(lengths, self.prefill_group_tokens)
        batch, ended = self._prefill_group([rows[i] for i in groups[0]])
        for group in groups[1:]:
            if not batch.can_join:  # one padded batch: this cache cannot be joined
                batch, ended = self._prefill_group(rows)
                break
            more, gone = self._prefill_group([rows[i] for i in group])
            ended += gone
            if not batch.rows:
                batch = more
            elif more.rows:
                batch = batch.join(more)
        self.stats["batches"] += 1
        self.stats["requests"] += len(rows)
        return batch, ended

    def _prefill_group(self, rows: list[_Row]) -> tuple[_Batch, list[_Row]]:
        """``_prefill`` for one left-padded batch."""
        import torch

        lengths = [len(row.request.prompt_ids) for row in rows]
        width = max(lengths)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):  # left padding: prompts end at the same column
            input_ids[i, width - lengths[i] :] = torch.tensor(row.request.prompt_ids)
            attention[i, width - lengths[i] :] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        batch = _Batch(
            rows,
            attention=attention.to(self.device),
            positions=positions[:, -1].to(self.device) + 1,
            temperature=torch.tensor(
                [r.request.temperature for r in rows], dtype=torch.float32, device=self.device
            ),
            top_p=torch.tensor(
                [r.request.top_p for r in rows], dtype=torch.float32, device=self.device
            ),
        )
        with self._compute, torch.inference_mode():
            for row in rows:
                row.version = self.version
            out = self.model(
                input_ids=input_ids.to(self.device),
                attention_mask=batch.attention,
                position_ids=positions.to(self.device),
                use_cache=True,
                logits_to_keep=1,  # only the next token's: not rows x prompt x vocabulary
            )
            batch.cache = _growing(out.past_key_values)
            ended = self._advance(batch, out.logits[:, -1])
        return batch, ended

    def _step(self, batch: _Batch) -> list[_Row]:
        """One decoding step for every row of ``batch`` (the token each row sampled last);
        the rows that ended."""
        import torch

        ones = torch.ones((len(batch.rows), 1), dtype=batch.attention.dtype, device=self.device)
        batch.attention = torch.cat([batch.attention, ones], dim=1)
        with self._compute, torch.inference_mode():
            out = self.model(
                input_ids=batch.tokens[:, None],
                attention_mask=batch.attention,
                position_ids=batch.positions[:, None],
                past_key_values=batch.cache,
                use_cache=True,
            )
            batch.cache = out.past_key_values
            batch.positions = batch.positions + 1
            return self._advance(batch, out.logits[:, -1])

    def _advance(self, batch: _Batch, logits: torch.Tensor) -> list[_Row]:
        """Sample each row's next token from ``logits``, record it, and drop the rows that
        ended from the batch (their KV cache too), so no step computes a finished row."""
        tokens, logprobs = self._sample(logits.float(), batch.temperature, batch.top_p)
        ended: list[int] = []
        for i, (row, token, logprob) in enumerate(
            zip(batch.rows, tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            if row.append(token, logprob, aborted=row.request.request_id in self._aborted):
                ended.append(i)
        self.stats["new_tokens"] += len(batch.rows)
        batch.tokens = tokens
        return batch.drop(ended) if ended else []

    def _sample(
        self, logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: greedy when temperature is 0, else nucleus sampling from ``softmax(z / T)``,
        on the logits' device: one uniform per row from the engine's CPU generator (so a seed
        gives the same tokens on any device), inverted through the row's cumulative
        distribution. Only the sampled ids and their log-probs leave the device."""
        import torch

        greedy = temperature <= 0
        scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
        logprobs = torch.log_softmax(scaled, dim=-1)
        if bool(greedy.all()):  # evaluation: no sampling, and the RNG is left untouched
            tokens = logits.argmax(-1)
        else:
            probs = logprobs.exp()
            order: torch.Tensor | None = None
            if bool((top_p < 1).any()):
                probs, order = probs.sort(dim=-1, descending=True)
                probs = probs * ((probs.cumsum(-1) - probs) < top_p[:, None])
            cdf = probs.cumsum(-1)
            uniform = torch.rand(len(logits), generator=self.generator).to(logits.device)
            picked = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)
            picked = picked.clamp(max=cdf.shape[-1] - 1)
            # rounding can land past the last token with any mass: take that token instead
            last = cdf.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1, keepdim=True)
            picked = torch.minimum(picked, last).squeeze(-1)
            sampled = picked if order is None else order.gather(-1, picked[:, None]).squeeze(-1)
            tokens = torch.where(greedy, logits.argmax(-1), sampled)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


class _Row:
    """One request being generated: its tokens so far, why it ended, and (when submitted to
    the decoding thread) the future its result goes to."""

    __slots__ = ("future", "ids", "limit", "logprobs", "reason", "request", "stops", "version")

    def __init__(
        self,
        request: GenerationRequest,
        eos_token_id: int,
        future: concurrent.futures.Future[GenerationResult] | None = None,
    ) -> None:
        self.request, self.future = request, future
        self.stops = {eos_token_id, *request.stop_token_ids}
        self.limit = request.max_new_tokens
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.reason: FinishReason | None = None
        self.version = 0

    def append(self, token: int, logprob: float, *, aborted: bool) -> bool:
        """Record a sampled token; True when the row has ended."""
        self.ids.append(token)
        self.logprobs.append(logprob)
        if token in self.stops:
            self.reason = "stop"
        elif aborted:
            self.reason = "abort"
        elif len(self.ids) >= self.limit:
            self.reason = "length"
        return self.reason is not None

    def end(self, reason: FinishReason) -> _Row:
        """End the row now (with the tokens it has) and answer its future."""
        self.reason = self.reason or reason
        self.answer()
        return self

    def answer(self) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_result(self.result())

    def fail(self, error: BaseException) -> None:
        """End the row with ``error`` (what its future raises)."""
        self.reason = self.reason or "abort"
        if self.future is not None and not self.future.done():
            self.future.set_exception(error)

    def result(self) -> GenerationResult:
        return GenerationResult(
            self.request.request_id, self.ids, self.logprobs, self.reason or "length", self.version
        )


class _Batch:
    """Rows decoded together: their left-padded attention mask, next positions, last sampled
    tokens, sampling settings and KV cache, all indexed like ``rows``."""

    def __init__(
        self,
        rows: list[_Row],
        *,
        attention: torch.Tensor,
        positions: torch.Tensor,
        temperature: torch.Tensor,
        top_p: torch.Tensor,
    ) -> None:
        self.rows = list(rows)
        self.attention, self.positions = attention, positions
        self.temperature, self.top_p = temperature, top_p
        self.tokens: Any = None
        self.cache: Any = None

    @property
    def can_join(self) -> bool:
        """Whether other rows' caches can be joined to this one's (plain per-layer key/value
        tensors; not sliding-window or recurrent layers)."""
        layers: list[Any] = list(getattr(self.cache, "layers", None) or [])
        plain = {"DynamicLayer", "GrowingLayer"}
        return bool(layers) and all(type(layer).__name__ in plain for layer in layers)

    def drop(self, ended: list[int]) -> list[_Row]:
        """Remove the rows at ``ended`` (and the padding columns no remaining row needs);
        those rows."""
        import torch

        gone = set(ended)
        out = [row for i, row in enumerate(self.rows) if i in gone]
        keep_list = [i for i in range(len(self.rows)) if i not in gone]
        self.rows = [self.rows[i] for i in keep_list]
        if not self.rows:
            self.cache = self.tokens = None
            return out
        keep = torch.tensor(keep_list, device=self.attention.device)
        self.attention = self.attention[keep]
        self.positions, self.tokens = self.positions[keep], self.tokens[keep]
        self.temperature, self.top_p = self.temperature[keep], self.top_p[keep]
        self.cache.batch_select_indices(keep)
        first = int(self.attention.any(0).int().argmax())  # columns only ended rows used
        if first and self.can_join:
            self.attention = self.attention[:, first:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[..., first:, :], layer.values[..., first:, :]
        return out

    def join(self, other: _Batch) -> _Batch:
        """This batch with ``other``'s rows after its own: the narrower one's mask and cache
        are left-padded to the wider one's columns (masked out), then stacked."""
        import torch

        width = max(self.attention.shape[1], other.attention.shape[1])

        def pad(tensor: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - tensor.shape[dim]
            if not missing:
                return tensor
            shape = list(tensor.shape)
            shape[dim] = missing
            return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)

        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([pad(mine.keys, -2), pad(theirs.keys, -2)])
            mine.values = torch.cat([pad(mine.values, -2), pad(theirs.values, -2)])
        self.attention = torch.cat([pad(self.attention, 1), pad(other.attention, 1)])
        self.rows += other.rows
        self.positions = torch.cat([self.positions, other.positions])
        self.tokens = torch.cat([self.tokens, other.tokens])
        self.temperature = torch.cat([self.temperature, other.temperature])
        self.top_p = torch.cat([self.top_p, other.top_p])
        return self


def _length_groups(lengths: list[int], min_tokens: int = 2048) -> list[list[int]]:
    """Indices of ``lengths`` in groups to prefill together: longest first, a group takes
    prompts at least half as long as its first (so no prompt is padded to more than twice its
    length), and keeps taking any prompt while it holds fewer than ``min_tokens`` padded
    tokens (a forward pass of its own would cost more than the padding)."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups:
            head = lengths[groups[-1][0]]
            if 2 * lengths[i] >= head or len(groups[-1]) * head < min_tokens:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def _growing(cache: Any) -> Any:
    """``cache`` with its plain layers made ``_GrowingLayer`` (decoding appends in place)."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if layers and all(type(layer) is DynamicLayer for layer in layers):
        for layer in layers:
            layer.__class__ = _growing_layer_class()
    return cache


_GROWING: Any = None


def _growing_layer_class() -> Any:
    """``transformers``' ``DynamicLayer`` whose ``update`` writes the new keys and values into
    spare room at the end of a buffer instead of concatenating (a copy of the whole cache at
    every decoding step); ``keys``/``values`` are views of the buffers. Anything that replaces
    ``keys``/``values`` (a batch selection, ``_Batch.join``/``drop``) simply gets a new buffer
    at the next update. Built on first use: importing ``transformers`` is slow."""
    global _GROWING
    if _GROWING is not None:
        return _GROWING
    import torch
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        spare = 64  # tokens of room made at each reallocation

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = self.keys, self.values
            if not self.is_initialized or keys is None or values is None or not keys.numel():
                return super().update(key_states, value_states, *args, **kwargs)
            used, end = keys.shape[-2], keys.shape[-2] + key_states.shape[-2]
            buffers: tuple[torch.Tensor, torch.Tensor] | None = getattr(self, "_room", None)
            if (
                buffers is None
                or buffers[0].data_ptr() != keys.data_ptr()
                or buffers[0].shape[:-2] != keys.shape[:-2]
                or buffers[0].shape[-2] < end
            ):
                room = (*keys.shape[:-2], end - used + self.spare, keys.shape[-1])
                buffers = (
                    torch.cat([keys, keys.new_empty(room)], -2),
                    torch.cat([values, values.new_empty(room)], -2),
                )
                self._room = buffers
            buffers[0][..., used:end, :] = key_states
            buffers[1][..., used:end, :] = value_states
            self.keys, self.values = buffers[0][..., :end, :], buffers[1][..., :end, :]
            return self.keys, self.values

    _GROWING = GrowingLayer
    return _GROWING


def _check_prompts(requests: list[GenerationRequest]) -> None:
    if any(not r.prompt_ids for r in requests):
        raise ValueError(
            "a generation request has no prompt tokens; render the chat template first"
        )


def _answer_in(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[GenerationResult]
) -> Callable[[concurrent.futures.Future[GenerationResult]], None]:
    """A done-callback that answers ``future`` (on ``loop``) like the thread's future."""

    def answer(done: concurrent.futures.Future[GenerationResult]) -> None:
        def settle() -> None:
            if future.done():
                return
            error = done.exception()
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(done.result())

        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody waits for this answer any more
            pass

    return answer
