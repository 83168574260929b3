"""``HFEngine``: the embedded ``InferenceEngine``, continuous batching of torch generation with
a KV cache.

Requests arriving while the event loop is busy are gathered (the front yields to the loop
until no new request shows up, so every episode whose turn just ended comes together) and
handed to the engine's decoding thread, which admits them between two decoding steps: their
prompts are prefilled as left-padded batches of similar length and their KV caches joined to
the running rows'. Every step then decodes one token for every running row; a row leaves the
batch (and its cache) as soon as it ends, at EOS (the tokenizer's, and the model's
generation-config EOS ids: ``model_eos``), at a request's stop tokens, at its own
``max_new_tokens``, or when aborted, so no step computes a finished row and a short turn
never waits for a long one. A turn that ended whole leaves its KV cache for its episode's
next turn (requests named ``episode/turn``, as rollouts and the proxy name them; kept within
``prefix_cache_gib``, dropped at every weight change): when that turn's prompt extends it,
only the new tokens (the observation, the template's markers) are prefilled. The event loop
keeps stepping envs and scoring rewards meanwhile. Threads without a loop use ``submit``;
``generate_batch`` runs one batch to the end in the caller's thread.

Sampling happens on the model's device: one uniform per row and step comes from the
engine's own CPU ``torch.Generator`` (seeded; saved by ``get_state``) and is inverted through
the row's cumulative distribution, so only the sampled ids and their log-probs leave the
device and the random stream is the same whatever the device (a resumed run, given the same
batches, generates what the run it continues did). The reported log-prob of a token is
``log_softmax(logits / temperature)`` over the whole vocabulary (plain ``log_softmax`` when
greedy): the trainer's log-probs at ``rollout.temperature`` (``hf.token_logprobs``), so valid
old log-probs for the PPO ratio. A weight update waits for the running step and applies to
the steps after it (a row's ``policy_version`` is the one it started under, like vLLM's). An
update is all or nothing: a bad tensor loads none of a mapping, and an iterator failing part-way
leaves the engine refusing to generate until a complete update (``hf_weights``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

from trainer.strategies.base import GenerationRequest, GenerationResult, Weights
from trainer.strategies.batching import BatchingFrontend, fail_batch
from trainer.strategies.decode_batch import (
    CachedPrefix,
    DecodeBatch,
    PrefixCache,
    Row,
    cache_joins,
    growing_cache,
    length_groups,
    prefill_split_tokens,
    request_error,
)
from trainer.strategies.hf_weights import EngineWeights, with_adapter
from trainer.weights.errors import StaleWeightsError

if TYPE_CHECKING:
    import torch

    from trainer.strategies.lora import AdapterWeights

__all__ = ["HFEngine"]


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
        prefix_cache_gib: float = 1.0,
        stop_token_ids: Iterable[int] = (),
    ) -> None:
        """``prefix_cache_gib``: memory (on ``device``) for the KV caches ended turns leave for
        their episode's next turn (``PrefixCache``; 0 turns it off). ``stop_token_ids``: ids
        every request stops on besides ``eos_token_id`` (the model's generation-config EOS ids:
        ``from_pretrained`` reads them)."""
        import torch

        super().__init__(max_batch_size=max_batch_size)
        self.model = model.to(device).eval()
        self.device = device
        self.prefill_group_tokens = prefill_split_tokens(model, device)
        """Prompts admitted together are prefilled in groups of similar length; a group of
        fewer padded tokens than this takes any prompt rather than start another pass."""
        self.eos_token_id, self.pad_token_id = int(eos_token_id), int(pad_token_id)
        self.stop_token_ids = tuple(sorted(set(map(int, stop_token_ids))))
        """What every request stops on besides EOS and its own ``stop_token_ids``."""
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.context: int | None = getattr(model.config, "max_position_embeddings", None)
        """The model's positions: longer prompts are refused, rows end when they are full."""
        self._joins = cache_joins(model.config)  # else prompts admitted together: one prefill
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self._weights = EngineWeights(self.model)
        self.stats = {"batches": 0, "requests": 0, "new_tokens": 0, "prefix_hit_tokens": 0}
        self.prefixes = PrefixCache(int(prefix_cache_gib * 2**30)) if prefix_cache_gib else None
        self._compute = threading.Lock()  # one forward at a time; weight updates between them
        self._admit = threading.Condition()  # guards _waiting, _thread, _closed
        self._waiting: list[Row] = []
        self._live: set[str] = set()  # ids submitted and not yet answered
        self._aborted: set[str] = set()  # of those, the ones to end at their next token
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
        prefix_cache_gib: float = 1.0,
        **options: Any,
    ) -> HFEngine:
        """The registry's ``hf`` engine: the policy at ``model_path``, on CUDA when visible
        (``lora_rank``: adapters will come; this engine needs nothing ahead of them). Its one
        option (``strategy_args``): ``prefix_cache_gib``, the memory for ended turns' KV caches
        (0: none kept)."""
        if options:
            raise ValueError(
                f"strategy_args {sorted(options)} are not options of the 'hf' inference engine "
                "(its one option is prefix_cache_gib)"
            )
        if not isinstance(prefix_cache_gib, int | float) or prefix_cache_gib < 0:
            raise ValueError(
                f"strategy_args.prefix_cache_gib must be a number >= 0 (GiB; 0 keeps no turn's "
                f"KV cache), got {prefix_cache_gib!r}"
            )
        import torch

        from trainer.models import load_policy
        from trainer.strategies.model_eos import model_eos_ids

        model, tokenizer = load_policy(model_path, dtype=dtype, chat=False)
        return cls(
            model,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            seed=seed,
            device="cuda" if torch.cuda.is_available() else "cpu",
            prefix_cache_gib=float(prefix_cache_gib),
            stop_token_ids=model_eos_ids(model_path),
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
            fail_batch(batch, error)
            return
        for (_, future), done in zip(batch, submitted, strict=True):
            done.add_done_callback(_answer_in(loop, future))

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        """Queue ``request`` for admission at the next step and return at once (for threads);
        raises ``ValueError`` for a request this engine cannot serve."""
        future = self.submit_many([request])[0]
        if future.done() and future.exception() is not None:
            raise cast(BaseException, future.exception())
        return future

    def submit_many(
        self, requests: list[GenerationRequest]
    ) -> list[concurrent.futures.Future[GenerationResult]]:
        """``submit`` for several requests that are admitted together (one prefill). A request
        the engine cannot serve (``request_error``) gets a future failed with why; the others
        go on. The futures are running already: ``abort_sync`` ends a request, not
        ``cancel()``. Raises ``StaleWeightsError`` after a weight update failed part-way."""
        self._check_weights()
        futures: list[concurrent.futures.Future[GenerationResult]] = []
        rows, stops = [], {self.eos_token_id, *self.stop_token_ids}
        for request in requests:
            future: concurrent.futures.Future[GenerationResult] = concurrent.futures.Future()
            future.set_running_or_notify_cancel()
            futures.append(future)
            error = self._refusal(request)
            if error is not None:
                future.set_exception(error)
            else:
                rows.append(Row(request, stops, future, context=self.context))
        if not rows:
            return futures
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
        return futures

    def _refusal(self, request: GenerationRequest) -> ValueError | None:
        return request_error(request, vocab_size=self.vocab_size, context=self.context)

    def _check_weights(self) -> None:
        if self._weights.broken is not None:
            raise StaleWeightsError(self._weights.broken)

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
        """Load full HF-named tensors (a mapping or an iterator of ``(name, tensor)``, all of
        the model's or some) between two steps; bumps ``version``. All or nothing: see
        ``hf_weights`` (``KeyError`` / ``ValueError``, and ``StaleWeightsError`` for
        generation after an iterator failed part-way)."""
        with self._compute:
            try:
                self._weights.load(weights)
            finally:  # keys and values of the old weights
                if self.prefixes is not None:
                    self.prefixes.clear()
            self.policy.advance()  # before any forward can run on the new weights
        with self._admit:  # a failed load: the decoding thread fails what it runs
            self._admit.notify()

    def load_adapter(self, adapter: AdapterWeights) -> None:
        """Serve the base weights with ``adapter`` (LoRA): the first call wraps the model with the
        adapter's ``peft`` config, every call loads its tensors; bumps the version. Base syncs
        (``update_weights``) keep reaching the base weights."""
        with self._compute:
            self.model = with_adapter(self.model, adapter)
            if self.prefixes is not None:
                self.prefixes.clear()
            self.policy.advance()

    def sleep(self) -> None:
        """Drop the ended turns' KV caches (the next weight update would; training, which may
        share the device, gets the memory meanwhile); the model stays where it is."""
        if self.prefixes is not None:
            with self._compute:
                self.prefixes.clear()

    def wake_up(self) -> None:
        """See ``sleep``."""

    def get_state(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "version": self.version}

    def set_state(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.policy.restore(int(state.get("version", self.version)))

    # ------------------------------------------------------------------ compute
    def generate_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Generate for ``requests`` as one batch, to the end (synchronous, in this thread);
        raises ``ValueError`` (running none) if one cannot be served."""
        self._check_weights()
        for error in map(self._refusal, requests):
            if error is not None:
                raise error
        stops = {self.eos_token_id, *self.stop_token_ids}
        rows = [Row(r, stops, context=self.context) for r in requests]
        batch, _ = self._prefill(rows)
        while batch.rows:
            self._step(batch)
        return [row.result() for row in rows]

    def _decode_loop(self) -> None:
        """The decoding thread: admit waiting rows between steps, step the running ones, answer
        each row's future as it ends; exits on ``shutdown`` (what it holds ends ``abort``)."""
        running: DecodeBatch | None = None
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
                ended: list[Row] = []
                if self._weights.broken is not None:  # a load failed part-way: none goes on
                    ended = self._waiting + (running.rows if running is not None else [])
                    for row in ended:
                        row.fail(StaleWeightsError(self._weights.broken))
                    self._waiting, running = [], None
                if self._aborted:  # aborted rows leave the queue now, however long it is
                    ended += [
                        row.end("abort")
                        for row in self._waiting
                        if row.request.request_id in self._aborted
                    ]
                    self._waiting = [row for row in self._waiting if row.reason is None]
                new, self._waiting = self._waiting[:room], self._waiting[room:]
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

    def _prefill(self, rows: list[Row]) -> tuple[DecodeBatch, list[Row]]:
        """Prefill the prompts of ``rows`` and sample each row's first token: the rows that go
        on (one batch, with their KV cache), and those that ended already. A row whose episode's
        previous turn left its KV cache (``PrefixCache``) prefills only the tokens after it;
        the others' prompts are prefilled whole, in groups of similar length
        (``length_groups``), so a short prompt is not padded to the longest one's width."""
        hits, entries, misses = [], [], []
        with self._compute:
            for row in rows:
                episode = PrefixCache.episode(row.request.request_id)
                entry = None
                if self.prefixes and episode is not None:
                    entry = self.prefixes.take(episode, row.request.prompt_ids)
                if entry is None:
                    misses.append(row)
                else:
                    hits.append(row)
                    entries.append(entry)
        parts = [self._prefill_whole(misses)] if misses else []
        if hits:
            parts.append(self._prefill_cached(hits, entries))
        batch, ended = functools.reduce(_joined, parts)
        self.stats["batches"] += 1
        self.stats["requests"] += len(rows)
        return batch, ended

    def _prefill_whole(self, rows: list[Row]) -> tuple[DecodeBatch, list[Row]]:
        """``_prefill`` for prompts prefilled whole (grouped by length, the groups joined)."""
        if not self._joins:  # one padded batch: this model's cache cannot be joined
            return self._prefill_group(rows)
        lengths = [len(row.request.prompt_ids) for row in rows]
        groups = length_groups(lengths, self.prefill_group_tokens)
        batch, ended = self._prefill_group([rows[i] for i in groups[0]])
        for group in groups[1:]:
            batch, ended = _joined((batch, ended), self._prefill_group([rows[i] for i in group]))
        return batch, ended

    def _prefill_cached(
        self, rows: list[Row], entries: list[CachedPrefix]
    ) -> tuple[DecodeBatch, list[Row]]:
        """``_prefill`` for rows whose prompts extend a cached prefix: the cached keys and
        values, left-padded to the longest, are the past of one forward over the new tokens
        (left-padded too: the mask hides both paddings, positions go on from each prefix)."""
        import torch
        from transformers.cache_utils import DynamicCache

        past = [len(entry.tokens) for entry in entries]
        new = [row.request.prompt_ids[n:] for row, n in zip(rows, past, strict=True)]
        width, wide = max(past), max(map(len, new))
        input_ids = torch.full((len(rows), wide), self.pad_token_id, dtype=torch.long)
        positions = torch.zeros((len(rows), wide), dtype=torch.long)
        attention = torch.zeros((len(rows), width + wide), dtype=torch.long)
        for i, (n, ids) in enumerate(zip(past, new, strict=True)):
            input_ids[i, wide - len(ids) :] = torch.tensor(ids)
            positions[i, wide - len(ids) :] = torch.arange(n, n + len(ids))
            attention[i, width - n : width] = 1
            attention[i, wide + width - len(ids) :] = 1
        layers = []
        for index, (keys, values) in enumerate(entries[0].layers):
            shape = (len(rows), keys.shape[0], width, keys.shape[-1])
            padded = keys.new_zeros(shape), values.new_zeros(shape)
            for i, (entry, n) in enumerate(zip(entries, past, strict=True)):
                padded[0][i, :, width - n :] = entry.layers[index][0]
                padded[1][i, :, width - n :] = entry.layers[index][1]
            layers.append(padded)
        cache = growing_cache(DynamicCache(ddp_cache_data=layers))
        self.stats["prefix_hit_tokens"] += sum(past)
        batch, ended = self._prefill_forward(rows, input_ids, attention, positions, cache)
        for row, entry in zip(rows, entries, strict=True):  # a weight update came in between:
            row.version = min(row.version, entry.version)  # the turn is as old as its prefix
        return batch, ended

    def _prefill_group(self, rows: list[Row]) -> tuple[DecodeBatch, list[Row]]:
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
        return self._prefill_forward(rows, input_ids, attention, positions)

    def _prefill_forward(
        self,
        rows: list[Row],
        input_ids: torch.Tensor,
        attention: torch.Tensor,
        positions: torch.Tensor,
        past: Any = None,
    ) -> tuple[DecodeBatch, list[Row]]:
        """One prefill forward: ``rows``' left-padded ``input_ids`` (with their mask, after the
        ``past`` cache if any, and positions), and each row's first token sampled."""
        import torch

        device = self.device
        batch = DecodeBatch(
            rows,
            attention=attention.to(device),
            positions=torch.tensor([len(r.request.prompt_ids) for r in rows], device=device),
            temperature=torch.tensor(
                [r.request.temperature for r in rows], dtype=torch.float32, device=device
            ),
            top_p=torch.tensor([r.request.top_p for r in rows], dtype=torch.float32, device=device),
        )
        with self._compute, torch.inference_mode():
            for row in rows:
                row.version = self.version
            out = self.model(
                input_ids=input_ids.to(device),
                attention_mask=batch.attention,
                position_ids=positions.to(device),
                past_key_values=past,
                use_cache=True,
                logits_to_keep=1,  # only the next token's: not rows x prompt x vocabulary
            )
            batch.cache = growing_cache(out.past_key_values)
            ended = self._advance(batch, out.logits[:, -1])
        return batch, ended

    def _step(self, batch: DecodeBatch) -> list[Row]:
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

    def _advance(self, batch: DecodeBatch, logits: torch.Tensor) -> list[Row]:
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
        if ended and self.prefixes is not None:
            self._keep_prefixes(batch, ended)
        return batch.drop(ended) if ended else []

    def _keep_prefixes(self, batch: DecodeBatch, ended: list[int]) -> None:
        """Keep the KV cache of each turn that ended whole (not aborted) under this policy
        version, for its episode's next turn (``PrefixCache``)."""
        if self.prefixes is None or not batch.can_join:  # plain layers only
            return
        for i in ended:
            row = batch.rows[i]
            episode = PrefixCache.episode(row.request.request_id)
            if episode is None or row.reason == "abort" or row.version != self.version:
                continue
            tokens = [*row.request.prompt_ids, *row.ids[:-1]]  # the last one was never input
            columns = batch.attention[i].nonzero().squeeze(-1)
            if len(columns) != len(tokens):
                continue
            layers = [
                (lay.keys[i][:, columns], lay.values[i][:, columns]) for lay in batch.cache.layers
            ]
            self.prefixes.put(episode, CachedPrefix(tokens, layers, row.version))

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


def _joined(
    first: tuple[DecodeBatch, list[Row]], second: tuple[DecodeBatch, list[Row]]
) -> tuple[DecodeBatch, list[Row]]:
    """Two prefills' outcomes as one: the second's rows joined after the first's (either may
    have none left), and the rows that ended in either."""
    (batch, ended), (more, gone) = first, second
    if not batch.rows:
        batch = more
    elif more.rows:
        batch = batch.join(more)
    return batch, ended + gone


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
