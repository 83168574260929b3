"""A simulated GPU inference engine, for running the real rollout path at cluster scale.

``SimEngine`` implements ``InferenceEngine`` (``trainer.strategies.base``) with no model: it
schedules requests the way vLLM does (continuous batching: a running set of at most
``max_num_seqs`` sequences, chunked prefill of at most ``max_batched_tokens`` tokens per step,
a KV-cache budget, a per-episode prefix cache) and takes the *simulated* time a GPU would take
for each step, from a ``StepCost`` roofline. Put behind an ``EngineRouter`` it drives the real
``RolloutScheduler``, ``EnvManager`` and envs; on a ``trainer.rollout.sim_clock`` loop the
GPU's seconds are skipped while the Python around it (the driver) runs in real time, so the
driver's own cost stays real. The engine's own Python (taking a request, each step's
bookkeeping: one loop callback per step) runs off that clock, as a GPU worker's process would
on a cluster. ``benchmarks/rollout_scale.py`` runs it at 1k-50k episodes.

What one engine step costs (``StepCost.step_seconds``)
    ``overhead + max(memory, compute)``: ``memory`` reads the weights once and the KV cache of
    every decoding sequence (``bytes / (HBM bandwidth x bandwidth_efficiency)``); ``compute``
    is ``2 x params`` FLOPs per token in the step (one per decoding sequence, plus the prefill
    chunk) plus attention over the context, at ``peak x compute_efficiency``. Below the ridge
    point (about 120 sequences for a 7B model in bf16 on an H200) a decode step costs nearly
    the same whatever the batch; above it, it grows linearly; prefill is proportional to the
    new tokens. The constants and where they come from are in ``H200`` and ``StepCost``.

What it models, and what not
    Modelled: queueing when ``max_num_seqs`` or the KV cache is full, chunked prefill mixed
    with decode steps, prefix-cache hits for an episode's next turn (sticky routing keeps it
    on one engine; only the new tokens are prefilled), aborts taking effect at the end of the
    running step, weight loads that keep the engine from stepping for ``sync_s``, and a GPU's
    independence from the driver: the engine keeps its own timeline, so a driver whose Python
    holds the loop delays when it sees results and sends requests, not the engine's steps.
    Not modelled: the tokens' values (each request gets ``max_new_tokens`` copies of
    ``token_id``, the last one ``eos_token_id`` when ``stop_at_budget``; log-prob
    ``logprob``), KV preemption (a request is admitted only when the KV cache can hold its
    prompt and its whole budget, so it never has to be evicted), CUDA-graph batch buckets,
    tensor parallelism.

``stall()`` makes the engine stop stepping and ignore aborts, like a hung GPU worker: whatever
it holds never returns (the rollout path's ``rollout.generate_timeout_s`` must end those turns).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainer.rollout.sim_clock import VirtualClockLoop, run
from trainer.strategies.base import FinishReason, GenerationRequest, GenerationResult, Weights
from trainer.weights.versioned import PolicyVersion, SharedVersion

__all__ = ["H200", "QWEN2_5_7B", "EngineStats", "GPUSpec", "SimEngine", "StepCost"]


@dataclass(frozen=True)
class GPUSpec:
    """A GPU's datasheet peaks."""

    name: str
    peak_flops: float
    """Dense bf16 tensor-core FLOP/s."""
    hbm_bytes_per_s: float
    """Memory bandwidth, bytes/s."""
    memory_bytes: float


H200 = GPUSpec("NVIDIA H200 SXM", peak_flops=989e12, hbm_bytes_per_s=4.8e12, memory_bytes=141e9)
"""NVIDIA's H200 SXM datasheet: 989 TFLOP/s dense bf16 (1,979 with sparsity), 4.8 TB/s HBM3e,
141 GB."""

QWEN2_5_7B: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "use_sliding_window": False,
}
"""``config.json`` of Qwen/Qwen2.5-7B-Instruct (the shape of ``examples/qwen2.5-7b-*``)."""


@dataclass(frozen=True)
class StepCost:
    """Simulated seconds of one engine step on one GPU (see the module docstring).

    Defaults and their sources: ``bandwidth_efficiency`` 0.85 is this project's H200 device
    memcpy (2,049 GB/s copied = 4.10 TB/s read + written, of 4.8; ``benchmarks/gpu/results/
    2026-11-29-h200-ipc.json``); ``step_overhead_s`` 1 ms is what is left of a published vLLM
    figure once bandwidth is accounted for (Llama-3.1-8B bf16 decoding one request at 75 tok/s
    = 13.3 ms a step on an A100-40GB, "77% of the memory-bandwidth ceiling": 10.3 ms of
    weights at 1.555 TB/s, 12.1 ms at 0.85 of it); ``compute_efficiency`` 0.5 of the dense peak
    for the step's matrix products is an assumption (no H200 inference MFU was measured here).
    """

    weight_bytes: float
    """Bytes of weights read once per step."""
    flops_per_token: float
    """Linear-layer FLOPs of one token (2 x parameters)."""
    attention_flops_per_context_token: float
    """Attention FLOPs of one token per token of context it attends to (4 x layers x q_dim)."""
    kv_bytes_per_token: float
    gpu: GPUSpec = H200
    bandwidth_efficiency: float = 0.85
    compute_efficiency: float = 0.5
    step_overhead_s: float = 1e-3

    @classmethod
    def for_model(
        cls, config: Mapping[str, Any], gpu: GPUSpec = H200, dtype_bytes: int = 2, **options: Any
    ) -> StepCost:
        """The cost of the model a HF ``config.json`` describes (``trainer.model_shape``)."""
        from trainer.model_shape import ModelShape

        shape = ModelShape.from_config(config)
        return cls(
            weight_bytes=shape.num_params * dtype_bytes,
            flops_per_token=2.0 * shape.num_params,
            attention_flops_per_context_token=4.0 * shape.num_layers * shape.q_dim,
            kv_bytes_per_token=shape.kv_bytes_per_token(dtype_bytes),
            gpu=gpu,
            **options,
        )

    def step_seconds(
        self,
        decode_seqs: int,
        decode_context: int,
        prefill_tokens: int = 0,
        prefill_context: float = 0.0,
    ) -> float:
        """One step: ``decode_seqs`` sequences each make a token, attending to
        ``decode_context`` tokens in all; ``prefill_tokens`` prompt tokens are computed,
        attending to ``prefill_context`` tokens in all (sum over those tokens)."""
        memory = (self.weight_bytes + decode_context * self.kv_bytes_per_token) / (
            self.gpu.hbm_bytes_per_s * self.bandwidth_efficiency
        )
        flops = (decode_seqs + prefill_tokens) * self.flops_per_token + (
            decode_context + prefill_context
        ) * self.attention_flops_per_context_token
        compute = flops / (self.gpu.peak_flops * self.compute_efficiency)
        return self.step_overhead_s + max(memory, compute)

    def kv_capacity_tokens(self, memory_utilization: float = 0.9) -> int:
        """Tokens of KV cache that fit next to the weights in ``memory_utilization`` of the GPU
        (vLLM's ``gpu_memory_utilization``; activations ignored)."""
        free = self.gpu.memory_bytes * memory_utilization - self.weight_bytes
        return max(0, int(free // self.kv_bytes_per_token))


_WAITING, _PREFILLING, _DECODING, _DONE = range(4)


@dataclass(eq=False)
class _Seq:
    """One request inside the engine."""

    request: GenerationRequest
    future: asyncio.Future[GenerationResult]
    key: str
    prompt: int
    budget: int
    to_prefill: int = 0
    """Prompt tokens still to compute (the rest came from the prefix cache or earlier chunks)."""
    state: int = _WAITING
    start_step: int = -1
    """The step that made its first token."""
    aborted: bool = False
    arrived: float = 0.0
    """Simulated time it was sent: no step that began earlier takes it."""

    @property
    def reserved(self) -> int:
        """KV tokens held for it while running: prompt + whole budget."""
        return self.prompt + self.budget


@dataclass
class EngineStats:
    """What one engine did (``SimEngine.stats``); seconds are simulated unless said."""

    steps: int = 0
    busy_s: float = 0.0
    """Simulated seconds spent in steps."""
    new_tokens: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    decode_seq_steps: int = 0
    """Sum over steps of the sequences decoding in it (/ steps: the mean decode batch)."""
    requests: int = 0
    aborted: int = 0
    waiting_peak: int = 0


_LOGPROB = -0.5
"""The log-prob every simulated token reports."""


class SimEngine:
    """A simulated vLLM-like engine on one GPU (see the module docstring)."""

    version = SharedVersion()

    def __init__(
        self,
        cost: StepCost,
        *,
        max_num_seqs: int = 256,
        max_batched_tokens: int = 8192,
        kv_capacity_tokens: int | None = None,
        sync_s: float = 0.0,
        token_id: int = 1,
        eos_token_id: int = 0,
        stop_at_budget: bool = True,
        policy: PolicyVersion | None = None,
    ) -> None:
        self.cost = cost
        self.max_num_seqs, self.max_batched_tokens = max_num_seqs, max_batched_tokens
        self.kv_capacity = (
            cost.kv_capacity_tokens() if kv_capacity_tokens is None else kv_capacity_tokens
        )
        self.sync_s = sync_s
        """Simulated seconds a weight load keeps the engine from stepping."""
        self.token_id, self.eos_token_id = token_id, eos_token_id
        self.stop_at_budget = stop_at_budget
        self.policy = policy if policy is not None else PolicyVersion()
        self.stats = EngineStats()
        self._by_id: dict[str, _Seq] = {}
        self._waiting: collections.deque[_Seq] = collections.deque()
        """Arrival order; aborted entries stay until they reach the front (``state`` says)."""
        self._waiting_count = 0
        self._prefilling: collections.deque[_Seq] = collections.deque()
        self._finishing: list[tuple[int, int, _Seq]] = []
        """Heap of (step that makes the last token, arrival, seq) of decoding sequences."""
        self._aborting: list[_Seq] = []
        self._arrivals = itertools.count()
        self._running = 0
        self._decoding = 0
        self._decode_context = 0
        """Sum of the decoding sequences' contexts (prompt + tokens made)."""
        self._reserved = 0
        self._cache: collections.OrderedDict[str, int] = collections.OrderedDict()
        """Episode key -> tokens of its last turn still in the KV cache (LRU, evictable)."""
        self._cached = 0
        self._step = 0
        self._free_at = 0.0
        """Simulated time the last step ends: the next one starts then (or when work arrives),
        however late the loop runs its callback."""
        self._blocked_until = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stalled = False
        self._timer: asyncio.Handle | None = None
        """The engine's next callback (a step's start or end); None while idle or stalled."""

    # ------------------------------------------------------------------ InferenceEngine
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await self.start_generate(request)

    def start_generate(self, request: GenerationRequest) -> asyncio.Future[GenerationResult]:
        """``generate`` as a future (``EngineRouter`` asks without a task); cancelling it gives
        the request up."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first use, or a new loop: nothing scheduled on this one
            self._loop, self._timer = loop, None
        with self._off_clock():  # taking the request is the engine's work
            return self._take(request, loop).future

    def _take(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> _Seq:
        prompt = len(request.prompt_ids)
        key = request.request_id.rpartition("/")[0] or request.request_id
        seq = _Seq(
            request,
            loop.create_future(),
            key,
            prompt,
            max(1, request.max_new_tokens),
            arrived=loop.time(),
        )
        self._by_id[request.request_id] = seq
        self._waiting.append(seq)
        self._waiting_count += 1
        self.stats.requests += 1
        self.stats.waiting_peak = max(self.stats.waiting_peak, self._waiting_count)
        self._kick()
        return seq

    def generate_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """The requests at once, on a fresh virtual clock (blocking; not inside a running loop)."""

        async def all_of() -> list[GenerationResult]:
            try:
                return list(await asyncio.gather(*(self.generate(r) for r in requests)))
            finally:
                await self.close()

        return run(all_of())

    async def abort(self, request_id: str) -> None:
        """A waiting request ends now, a running one at the end of the current step; unknown or
        finished ids are ignored, and a stalled engine answers nothing."""
        seq = self._by_id.get(request_id)
        if seq is None or seq.aborted or self._stalled:
            return
        seq.aborted = True
        if seq.state == _WAITING:
            self._finish(seq, "abort")
        else:
            self._aborting.append(seq)
            self._kick()

    def update_weights(self, weights: Weights) -> None:
        """New weights (their values are not used): the engine does not step for ``sync_s``
        simulated seconds from now."""
        if not isinstance(weights, Mapping):
            for _ in weights:  # an iterator is consumed, as a real load would
                pass
        now = self._loop.time() if self._loop is not None else 0.0  # thread-safe: a clock read
        self._blocked_until = now + self.sync_s
        self.policy.advance()

    def sleep(self) -> None:
        """Nothing to release."""

    def wake_up(self) -> None:
        """See ``sleep``."""

    def get_state(self) -> dict[str, Any]:
        return {"version": self.version}

    def set_state(self, state: dict[str, Any]) -> None:
        self.policy.restore(int(state.get("version", self.version)))

    async def close(self) -> None:
        """Stop stepping; everything still held ends as ``abort``."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for seq in list(self._by_id.values()):
            self._finish(seq, "abort")

    # ------------------------------------------------------------------ faults, introspection
    def stall(self) -> None:
        """Stop stepping and answering aborts (a hung GPU worker): nothing held returns."""
        self._stalled = True

    @property
    def held(self) -> int:
        """Requests held: waiting, prefilling or decoding."""
        return len(self._by_id)

    # ------------------------------------------------------------------ the step loop
    # Plain loop callbacks, not a task sleeping per step: one callback per step, run off a
    # VirtualClockLoop's clock (a GPU worker's own CPU is not the driver's).
    def _kick(self) -> None:
        """Work arrived (a request, an abort): start a step unless one is scheduled."""
        if self._timer is None and not self._stalled and self._loop is not None:
            self._timer = self._loop.call_soon(self._start_step)

    def _off_clock(self) -> contextlib.AbstractContextManager[Any]:
        """The engine's own work, kept off a ``VirtualClockLoop``'s clock."""
        loop = self._loop
        return loop.uncharged() if isinstance(loop, VirtualClockLoop) else contextlib.nullcontext()

    def _start_step(self) -> None:
        """Start the next step on the engine's own timeline: when the last one ended (or the
        weight load did), or now if it was idle. A loop that ran this late (the driver's Python
        held it) does not delay the GPU: the steps due meanwhile follow each other at once,
        and requests sent meanwhile join the first step after they were."""
        loop = self._loop
        if loop is None:
            return
        with self._off_clock():
            self._timer = None
            if self._blocked_until > loop.time():  # a weight load in progress
                self._timer = loop.call_at(self._blocked_until, self._start_step)
                return
            self._settle_aborts()
            start = max(self._free_at, self._blocked_until)
            if not self._running:  # idle: the step starts now, with what arrived
                start = max(start, loop.time())
            self._admit(start)
            prefill_tokens, prefill_context, chunks = self._plan_prefill()
            if self._stalled or (not self._decoding and not chunks):
                return  # idle until ``_kick``
            seconds = self.cost.step_seconds(
                self._decoding, self._decode_context, prefill_tokens, prefill_context
            )
            self.stats.steps += 1
            self.stats.busy_s += seconds
            self.stats.decode_seq_steps += self._decoding
            self._free_at = start + seconds
            self._timer = loop.call_at(self._free_at, self._step_done, chunks)

    def _step_done(self, chunks: list[tuple[_Seq, int]]) -> None:
        with self._off_clock():
            self._timer = None
            self._end_step(chunks)
            self._start_step()  # the next step starts as this one ends

    def _admit(self, start: float) -> None:
        """Start requests sent by ``start``, in arrival order, while slots and KV cache allow."""
        while self._waiting and self._running < self.max_num_seqs:
            seq = self._waiting[0]
            if seq.state != _WAITING:  # aborted while waiting
                self._waiting.popleft()
                continue
            if seq.arrived > start:  # sent after this step began: the next one takes it
                break
            if seq.reserved > self.kv_capacity:  # could never run: refused, as vLLM does
                self._waiting.popleft()
                self._waiting_count -= 1
                seq.state = _DONE
                del self._by_id[seq.request.request_id]
                seq.future.set_exception(
                    ValueError(
                        f"request {seq.request.request_id!r} needs {seq.reserved} KV tokens "
                        f"(prompt + max_new_tokens), more than the engine's {self.kv_capacity}; "
                        "lower max_new_tokens or the context length"
                    )
                )
                continue
            hit = self._cache.pop(seq.key, 0)
            self._cached -= hit
            if self._reserved + seq.reserved > self.kv_capacity:
                if hit:
                    self._cache[seq.key] = hit
                    self._cached += hit
                break
            self._waiting.popleft()
            self._waiting_count -= 1
            self._running += 1
            self._reserved += seq.reserved
            hit = min(hit, seq.prompt - 1)  # at least the last token is computed (its logits)
            seq.to_prefill = seq.prompt - hit
            seq.state = _PREFILLING
            self.stats.cached_tokens += hit
            self._prefilling.append(seq)
        self._evict()

    def _evict(self) -> None:
        while self._cache and self._reserved + self._cached > self.kv_capacity:
            _, tokens = self._cache.popitem(last=False)
            self._cached -= tokens

    def _plan_prefill(self) -> tuple[int, float, list[tuple[_Seq, int]]]:
        """This step's prefill chunks: first come, first served, within the token budget."""
        budget = self.max_batched_tokens - self._decoding
        tokens, context = 0, 0.0
        chunks: list[tuple[_Seq, int]] = []
        for seq in self._prefilling:
            if budget <= 0:
                break
            take = min(seq.to_prefill, budget)
            chunks.append((seq, take))
            tokens += take
            context += take * (seq.prompt - seq.to_prefill + take / 2)
            budget -= take
        return tokens, context, chunks

    def _end_step(self, chunks: list[tuple[_Seq, int]]) -> None:
        self._step += 1
        step = self._step
        self._decode_context += self._decoding  # every decoding sequence made a token
        self.stats.new_tokens += self._decoding
        for seq, take in chunks:
            if seq.state != _PREFILLING:  # aborted and settled meanwhile
                continue
            seq.to_prefill -= take
            self.stats.prefill_tokens += take
            if seq.to_prefill == 0:  # prompt done: this step made its first token
                self._prefilling.remove(seq)  # at the front: chunks are taken in order
                seq.state, seq.start_step = _DECODING, step
                self._decoding += 1
                self._decode_context += seq.prompt + 1
                self.stats.new_tokens += 1
                last = step + seq.budget - 1
                heapq.heappush(self._finishing, (last, next(self._arrivals), seq))
        while self._finishing and self._finishing[0][0] <= step:
            _, _, seq = heapq.heappop(self._finishing)
            if seq.state == _DECODING:
                self._finish(seq, "length")
        self._settle_aborts()

    def _settle_aborts(self) -> None:
        aborting, self._aborting = self._aborting, []
        for seq in aborting:
            self._finish(seq, "abort")

    def _finish(self, seq: _Seq, reason: FinishReason) -> None:
        """Release ``seq`` (slot, KV, counters) and answer its caller with what it made."""
        if seq.state == _DONE:
            return
        made = 0
        if seq.state == _WAITING:
            self._waiting_count -= 1  # the entry itself is dropped when it reaches the front
        else:
            self._running -= 1
            self._reserved -= seq.reserved
            if seq.state == _PREFILLING:
                self._prefilling.remove(seq)
            else:
                made = min(self._step - seq.start_step + 1, seq.budget)
                self._decoding -= 1
                self._decode_context -= seq.prompt + made
                if reason != "abort":  # the turn's KV stays cached for the episode's next one
                    self._cache[seq.key] = seq.prompt + made
                    self._cached += seq.prompt + made
                    self._evict()
        seq.state = _DONE
        del self._by_id[seq.request.request_id]
        self.stats.aborted += reason == "abort"
        ids = [self.token_id] * made
        if reason == "length" and self.stop_at_budget and ids:
            ids[-1], reason = self.eos_token_id, "stop"
        if not seq.future.done():
            seq.future.set_result(
                GenerationResult(
                    seq.request.request_id, ids, [_LOGPROB] * made, reason, self.version
                )
            )
