"""The state of an ``HFEngine`` decoding batch: its rows (``Row``: a request's tokens so far and
why it ended), the rows decoded together (``DecodeBatch``: left-padded attention mask,
positions, last tokens, sampling settings and the KV cache, with ``join`` and ``drop`` to admit
and retire rows between steps), how admitted prompts are grouped for prefill
(``length_groups``), a KV-cache layer that grows in place (``growing_cache``) and the KV caches
ended turns leave for their episode's next turn (``PrefixCache``).
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.strategies.base import FinishReason, GenerationRequest, GenerationResult

if TYPE_CHECKING:
    import torch

__all__ = [
    "CachedPrefix",
    "DecodeBatch",
    "PrefixCache",
    "Row",
    "cache_joins",
    "growing_cache",
    "length_groups",
    "prefill_split_tokens",
    "request_error",
]


class Row:
    """One request being generated: its tokens so far, why it ended, and (when submitted to
    the decoding thread) the future its result goes to."""

    __slots__ = ("future", "ids", "limit", "logprobs", "reason", "request", "stops", "version")

    def __init__(
        self,
        request: GenerationRequest,
        stops: Iterable[int],
        future: concurrent.futures.Future[GenerationResult] | None = None,
        *,
        context: int | None = None,
    ) -> None:
        """``stops``: the ids every request of the engine stops on (EOS, the model's
        generation-config EOS ids), besides the request's own ``stop_token_ids``. ``context``:
        the model's positions; the row ends (``length``) when they are full, however many tokens
        the request allows."""
        self.request, self.future = request, future
        self.stops = {*stops, *request.stop_token_ids}
        self.limit = request.max_new_tokens
        if context is not None:
            self.limit = min(self.limit, context - len(request.prompt_ids))
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

    def end(self, reason: FinishReason) -> Row:
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


class DecodeBatch:
    """Rows decoded together: their left-padded attention mask, next positions, last sampled
    tokens, sampling settings and KV cache, all indexed like ``rows``."""

    def __init__(
        self,
        rows: list[Row],
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

    def drop(self, ended: list[int]) -> list[Row]:
        """Remove the rows at ``ended`` (and the padding columns no remaining row needs);
        those rows."""
        import torch

        gone = set(ended)
        out = [row for i, row in enumerate(self.rows) if i in gone]
        order = [i for i in range(len(self.rows)) if i not in gone]
        if not order:
            self.rows, self.cache, self.tokens = [], None, None
            return out
        # the rows after the last one kept move into the holes before it: only they are copied
        live = len(order)
        holes = [i for i in range(live) if i in gone]
        movers = [i for i in order if i >= live]
        layers: list[Any] = list(getattr(self.cache, "layers", None) or [])
        if _in_buffers(layers):
            for layer in layers:
                layer.move_rows(holes, movers, live)
            order = list(range(live))
            for hole, mover in zip(holes, movers, strict=True):
                order[hole] = mover
        else:
            self.cache.batch_select_indices(torch.tensor(order, device=self.attention.device))
        self.rows = [self.rows[i] for i in order]
        keep = torch.tensor(order, device=self.attention.device)
        self.attention = self.attention[keep]
        self.positions, self.tokens = self.positions[keep], self.tokens[keep]
        self.temperature, self.top_p = self.temperature[keep], self.top_p[keep]
        first = int(self.attention.any(0).int().argmax())  # columns only ended rows used
        if first and self.can_join:
            self.attention = self.attention[:, first:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[..., first:, :], layer.values[..., first:, :]
        return out

    def join(self, other: DecodeBatch) -> DecodeBatch:
        """This batch with ``other``'s rows after its own: the narrower one's mask and cache
        are left-padded to the wider one's columns (masked out), then stacked."""
        import torch

        if not (self.can_join and other.can_join):
            raise RuntimeError(
                "HFEngine: this model's KV cache cannot take rows from another prefill "
                "(sliding-window or recurrent layers); its prompts are prefilled together"
            )
        width = max(self.attention.shape[1], other.attention.shape[1])

        def pad(tensor: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - tensor.shape[dim]
            if not missing:
                return tensor
            shape = list(tensor.shape)
            shape[dim] = missing
            return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)

        pairs = list(zip(self.cache.layers, other.cache.layers, strict=True))
        if self.attention.shape[1] >= other.attention.shape[1] and _in_buffers(
            [mine for mine, _ in pairs]
        ):  # into the buffers' spare rows: only the new rows are copied
            for mine, theirs in pairs:
                mine.append_rows(theirs.keys, theirs.values)
        else:
            for mine, theirs in pairs:
                mine.keys = torch.cat([pad(mine.keys, -2), pad(theirs.keys, -2)])
                mine.values = torch.cat([pad(mine.values, -2), pad(theirs.values, -2)])
        self.attention = torch.cat([pad(self.attention, 1), pad(other.attention, 1)])
        self.rows += other.rows
        self.positions = torch.cat([self.positions, other.positions])
        self.tokens = torch.cat([self.tokens, other.tokens])
        self.temperature = torch.cat([self.temperature, other.temperature])
        self.top_p = torch.cat([self.top_p, other.top_p])
        return self


def _in_buffers(layers: list[Any]) -> bool:
    """Every layer is a ``GrowingLayer`` whose keys and values are views of its buffers."""
    return bool(layers) and all(getattr(la, "room", lambda: None)() is not None for la in layers)


def length_groups(lengths: list[int], min_tokens: int = 2048) -> list[list[int]]:
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


PREFILL_SPLIT_FLOPS = {"cpu": 5e8, "cuda": 1e12}
"""What one more prefill forward pass costs besides its tokens' compute, as the FLOPs of padding
it is worth, per device type. CPU: about 1.5 ms of Python and dispatch per forward at the
~300 GFLOP/s that the matmuls reach on two cores (measured for ``benchmarks/hf_engine.py``'s
models). CUDA: an estimate, not measured here (a 24-layer model's kernel launches, ~5 ms, at
~200 TFLOP/s)."""


def prefill_split_tokens(model: Any, device: str) -> int:
    """``length_groups``' ``min_tokens`` for ``model`` on ``device``: the padded tokens a
    forward pass of its own would cost (``PREFILL_SPLIT_FLOPS`` over ``2 * parameters`` FLOPs a
    token), at most 4,096. A 0.1M-parameter model on CPU pads ~2,000 tokens rather than start
    another pass; a 30M one ~8, so its short prompts are not padded to its long ones."""
    params = sum(p.numel() for p in model.parameters())
    budget = PREFILL_SPLIT_FLOPS["cuda" if str(device).startswith("cuda") else "cpu"]
    return int(min(4096, budget / (2 * max(params, 1))))


def growing_cache(cache: Any) -> Any:
    """``cache`` with its plain layers made ``_GrowingLayer`` (decoding appends in place)."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if layers and all(type(layer) is DynamicLayer for layer in layers):
        for layer in layers:
            layer.__class__ = growing_layer_class()
    return cache


_GROWING: Any = None


def growing_layer_class() -> Any:
    """``transformers``' ``DynamicLayer`` whose ``update`` writes the new keys and values into
    spare room at the end of a buffer instead of concatenating (a copy of the whole cache at
    every decoding step); ``keys``/``values`` are views of the leading rows and columns of the
    buffers. Rows leaving make room by moving the last rows into their places (``move_rows``),
    joining rows go into spare rows (``append_rows``), so neither copies the whole cache;
    anything else that replaces ``keys``/``values`` (a join of wider rows, a trim of padding
    columns) gets a new buffer at the next update. Built on first use: importing
    ``transformers`` is slow."""
    global _GROWING
    if _GROWING is not None:
        return _GROWING
    import torch
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        spare = 64  # tokens of room made at each reallocation
        spare_rows = 16  # rows of room made when rows join a full buffer

        def room(self) -> tuple[torch.Tensor, torch.Tensor] | None:
            """The buffers ``keys``/``values`` are the leading rows and columns of (None: they
            are not views of buffers of this layer's)."""
            buffers: tuple[torch.Tensor, torch.Tensor] | None = getattr(self, "_room", None)
            keys = self.keys
            if (
                buffers is None
                or keys is None
                or buffers[0].data_ptr() != keys.data_ptr()
                or buffers[0].stride() != keys.stride()
            ):
                return None
            return buffers

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = self.keys, self.values
            if not self.is_initialized or keys is None or values is None or not keys.numel():
                return super().update(key_states, value_states, *args, **kwargs)
            rows, used = keys.shape[0], keys.shape[-2]
            end = used + key_states.shape[-2]
            buffers = self.room()
            if buffers is None or buffers[0].shape[-2] < end:
                room = (*keys.shape[:-2], end - used + self.spare, keys.shape[-1])
                buffers = (
                    torch.cat([keys, keys.new_empty(room)], -2),
                    torch.cat([values, values.new_empty(room)], -2),
                )
                self._room = buffers
            buffers[0][:rows, :, used:end] = key_states
            buffers[1][:rows, :, used:end] = value_states
            self.keys, self.values = buffers[0][:rows, :, :end], buffers[1][:rows, :, :end]
            return self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            """Keep the rows at ``indices``, selected from the buffers with their spare room
            (a selection of the views would be reallocated, whole, at the next update)."""
            buffers = self.room()
            if buffers is None or self.keys is None:
                super().batch_select_indices(indices)
                return
            used = self.keys.shape[-2]
            self._room = (buffers[0][indices], buffers[1][indices])
            self.keys, self.values = self._room[0][:, :, :used], self._room[1][:, :, :used]

        def move_rows(self, holes: list[int], movers: list[int], live: int) -> bool:
            """Keep the first ``live`` rows, the rows at ``movers`` copied into the ``holes``
            among them (only those rows move; no other row is copied); False when the cache
            is not in this layer's buffers (nothing done)."""
            buffers = self.room()
            if buffers is None or self.keys is None:
                return False
            used = self.keys.shape[-2]
            if holes:
                with torch.inference_mode():  # the buffers are inference tensors
                    for buffer in buffers:
                        buffer[holes, :, :used] = buffer[movers, :, :used]
            self.keys, self.values = buffers[0][:live, :, :used], buffers[1][:live, :, :used]
            return True

        def append_rows(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
            """Add rows (no wider than this layer's), left-padded with zeros to its width,
            into spare rows of the buffers (made, ``spare_rows`` more, when there are too
            few); False when they do not fit so (nothing done)."""
            buffers, mine = self.room(), self.keys
            if buffers is None or mine is None or keys.shape[-2] > mine.shape[-2]:
                return False
            rows, used, more = mine.shape[0], mine.shape[-2], keys.shape[0]
            if buffers[0].shape[0] < rows + more:
                shape = (more + self.spare_rows, *buffers[0].shape[1:])
                buffers = (
                    torch.cat([buffers[0][:rows], buffers[0].new_empty(shape)]),
                    torch.cat([buffers[1][:rows], buffers[1].new_empty(shape)]),
                )
                self._room = buffers
            pad = used - keys.shape[-2]
            with torch.inference_mode():  # the buffers are inference tensors
                for buffer, new in zip(buffers, (keys, values), strict=True):
                    buffer[rows : rows + more, :, :pad] = 0  # masked, but finite: 0 x NaN is NaN
                    buffer[rows : rows + more, :, pad:used] = new
            total = rows + more
            self.keys, self.values = buffers[0][:total, :, :used], buffers[1][:total, :, :used]
            return True

    _GROWING = GrowingLayer
    return _GROWING


def request_error(
    request: GenerationRequest, *, vocab_size: int, context: int | None
) -> ValueError | None:
    """Why an engine with this vocabulary and context (positions) cannot serve ``request``,
    naming what to change; None when it can. Checked per request before any runs, so a bad
    one fails alone (on a GPU an id outside the vocabulary is a device-side assert)."""
    name, prompt = repr(request.request_id), request.prompt_ids
    if not prompt:
        return ValueError(
            f"generation request {name} has no prompt tokens; render the chat template first"
        )
    if request.max_new_tokens < 1:
        return ValueError(
            f"generation request {name}: max_new_tokens must be >= 1, got {request.max_new_tokens}"
        )
    if not 0 < request.top_p <= 1:
        return ValueError(
            f"generation request {name}: top_p must be in (0, 1] (1 keeps every token), got "
            f"{request.top_p}"
        )
    if not request.temperature >= 0:  # NaN too
        return ValueError(
            f"generation request {name}: temperature must be >= 0 (0 is greedy), got "
            f"{request.temperature}"
        )
    low, high = min(prompt), max(prompt)
    if low < 0 or high >= vocab_size:
        return ValueError(
            f"generation request {name}: token id {low if low < 0 else high} is outside the "
            f"model's vocabulary (0..{vocab_size - 1}); encode prompts with this model's "
            "tokenizer"
        )
    if context is not None and len(prompt) >= context:
        return ValueError(
            f"generation request {name}: its prompt has {len(prompt)} tokens and the model "
            f"takes {context} positions in all; shorten the prompt (an episode's history: "
            "fewer turns, or shorter observations)"
        )
    return None


def cache_joins(config: Any) -> bool:
    """Whether the KV cache a model with ``config`` builds can take rows from another
    prefill (plain per-layer keys and values: no sliding-window or recurrent layers), read
    from the cache transformers builds for it before anything runs."""
    from transformers.cache_utils import DynamicCache

    try:
        layers = list(DynamicCache(config=config).layers)
    except Exception:  # noqa: BLE001 - a cache this check does not know: never joined
        return False
    return bool(layers) and all(type(layer).__name__ == "DynamicLayer" for layer in layers)


@dataclass
class CachedPrefix:
    """An ended turn's KV cache: ``tokens`` (its prompt and every generated token but the last,
    whose keys and values were never computed) and per layer their keys and values
    (``[heads, len(tokens), head_dim]`` each)."""

    tokens: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    version: int
    """The policy version the keys and values were computed under."""

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


class PrefixCache:
    """The KV caches of ended turns, one per episode (the request id up to its last ``/``, as
    rollouts name their turns), least recently stored evicted beyond ``max_bytes``. An
    episode's next turn whose prompt extends the cached tokens prefills only the new ones (what
    vLLM's automatic prefix caching does for a multi-turn episode); a prompt that does not (a
    chat template that rewrote history) is prefilled whole. Entries hold keys and values of
    one policy version: ``clear`` on every weight change."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: collections.OrderedDict[str, CachedPrefix] = collections.OrderedDict()

    @staticmethod
    def episode(request_id: str) -> str | None:
        """The episode of a request named ``episode/turn`` (None: not an episode's turn)."""
        head, sep, _ = request_id.rpartition("/")
        return head if sep else None

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, episode: str, entry: CachedPrefix) -> None:
        """Keep ``entry`` as ``episode``'s (replacing an older one), evicting the least recently
        stored entries beyond ``max_bytes`` (an entry larger than that is not kept)."""
        self._drop(episode)
        size = entry.nbytes
        if size > self.max_bytes:
            return
        while self._entries and self.bytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[episode] = entry
        self.bytes += size

    def take(self, episode: str, prompt: list[int]) -> CachedPrefix | None:
        """``episode``'s entry, removed, when ``prompt`` extends its tokens by at least one;
        None otherwise (the entry is dropped either way: the turn replaces it)."""
        entry = self._entries.get(episode)
        if entry is None:
            return None
        self._drop(episode)
        n = len(entry.tokens)
        if len(prompt) <= n or prompt[:n] != entry.tokens:
            return None
        return entry

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def _drop(self, episode: str) -> None:
        entry = self._entries.pop(episode, None)
        if entry is not None:
            self.bytes -= entry.nbytes
