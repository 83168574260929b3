"""Never serving a half sync: :class:`VersionedEngine` and the trainer's :func:`confirm_versions`.

``VersionedEngine`` wraps any ``InferenceEngine``. A sync announces a version and the names
it will send; while it runs - and after one that failed half way - the wrapper refuses to
generate (``StaleWeightsError``) instead of sampling from a mix of old and new tensors. After
the last bucket it checks every announced name arrived and that the engine took the update,
and only then serves the new ``weights_version``. ``confirm_versions`` is the trainer's check
after each sync that every engine reports the version it just sent. The transports that
carry the buckets are in ``trainer.weights.transport``.

:class:`PolicyVersion` is the run's one policy version on the driver: the ``WeightSync``
advances it after each confirmed sync and every driver-side reader holds the same object.
A worker's ``VersionedEngine.weights_version`` is that worker's copy, told by the sync.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, overload

from trainer.weights.errors import StaleWeightsError, VersionReusedError

if TYPE_CHECKING:
    import torch

    from trainer.strategies.base import GenerationRequest, GenerationResult
    from trainer.strategies.lora import AdapterWeights

__all__ = ["PolicyVersion", "SharedVersion", "TensorSource", "VersionedEngine", "confirm_versions"]

_END = object()  # end of a multi-call weight update

DEFAULT_TIMEOUT_S = 300.0
"""How long a sync waits on an engine by default (``weight_sync.timeout_s``)."""


class TensorSource(Protocol):
    """What ``VersionedEngine.load`` reads: a ``buckets.Bucket``, or any set of named tensors."""

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class PolicyVersion:
    """The policy version: how many complete weight updates the inference engines have taken.

    One object per run, on the driver, with one writer: whoever applies the updates. In a
    training run that is the ``WeightSync``, which announces ``value + 1``, and advances it
    only once every engine confirmed serving that version; a checkpoint resume ``restore``-s
    it. An engine front used without a trainer (an ``HFEngine`` in a test or an eval) owns
    one of its own. Everything else on the driver that needs the current version (engine
    fronts, the rollout router, the scheduler's staleness bound, checkpoints) is handed the
    same object and reads ``value``; none keeps a counter of its own to reconcile.

    Inference workers run in other processes and cannot share it: the sync tells them each
    version (``begin_weight_load(version)``, the broadcast's end marker), they serve it as
    ``VersionedEngine.weights_version``, and ``confirm_versions`` checks they all agree.
    """

    __slots__ = ("_value",)

    def __init__(self, value: int = 0) -> None:
        self._value = _version(value)

    @property
    def value(self) -> int:
        """The version of the weights the engines serve (0: the initial policy, before updates)."""
        return self._value

    def advance(self) -> int:
        """One complete update was applied: the version goes up by one; returns the new version."""
        self._value += 1
        return self._value

    def restore(self, value: int) -> None:
        """Continue from ``value`` (a checkpoint's version, or an engine's saved state)."""
        self._value = _version(value)

    def __repr__(self) -> str:
        return f"PolicyVersion({self._value})"


class SharedVersion:
    """A ``version`` attribute that reads ``self.policy.value`` (a :class:`PolicyVersion`).

    For classes that report the run's version as a plain int (engine fronts, the ``WeightSync``)
    without keeping a copy of it. It is read-only: the owner calls ``policy.advance()`` or
    ``policy.restore()``, so no second writer can appear unnoticed.
    """

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> SharedVersion: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> int: ...
    def __get__(self, obj: Any, owner: type | None = None) -> SharedVersion | int:
        return self if obj is None else obj.policy.value

    def __set__(self, obj: Any, value: int) -> None:
        raise AttributeError(
            f"{type(obj).__name__}.version is read-only: it is the run's PolicyVersion; "
            "call .policy.advance() (one update applied) or .policy.restore(v) (a resume)"
        )


def _version(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"a policy version is a whole number >= 0, got {value!r}; pass the version a "
            "checkpoint or an engine's get_state() recorded"
        )
    return value


class VersionedEngine:
    """An ``InferenceEngine`` that serves only complete, announced weight versions.

    Versions only go up: a sync announcing a version this engine already served (or an older
    one) is refused before anything changes - two ``WeightSync``s of one run that do not share
    its ``PolicyVersion`` would otherwise label a different policy with a used number. Two
    exceptions: ``again=True`` (the driver retries a sync that failed on other engines after
    this one completed it) and ``set_state`` (restoring a saved engine state).
    """

    def __init__(self, engine: Any, *, weights_version: int = 0) -> None:
        self.engine = engine
        self.weights_version: int | None = weights_version
        """The version being served; None during a sync and after a failed one."""
        self.last_served = weights_version
        """The newest version this engine served (kept through a failed sync)."""
        self._version_before = 0
        """The engine's own ``version`` when the running sync began (it must bump it)."""
        # a sync spread over several calls (``begin`` ... ``finish``); None when none runs
        self._target: int | None = None
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=2)
        self._seen: list[str] = []
        self._error: BaseException | None = None
        self._timeout_s = DEFAULT_TIMEOUT_S
        self._cancelled = threading.Event()
        """Set when the running multi-call update is abandoned: its stream raises at the next
        read, so an engine that was stuck cannot complete it later."""

    @property
    def version(self) -> int:
        return self.engine.version

    def load(
        self,
        buckets: Iterable[TensorSource],
        *,
        version: int,
        expected_names: Sequence[str],
        again: bool = False,
    ) -> int:
        """Apply all ``buckets`` as one update; serve ``version`` only if every tensor arrived."""
        self.check_announced(version, again=again)
        return self.load_stream(buckets, lambda: (version, expected_names))

    def load_stream(
        self, buckets: Iterable[TensorSource], closing: Callable[[], tuple[int, Sequence[str]]]
    ) -> int:
        """Like ``load``, but the version and names are known only once ``buckets`` ran out
        (a caller that knows the version earlier checks it first: ``check_announced``)."""
        self.abandon_sync()
        self.weights_version = None
        self._version_before = self.engine.version
        seen: list[str] = []

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for bucket in buckets:
                for name, tensor in bucket.tensors():
                    seen.append(name)
                    yield name, tensor

        self.engine.update_weights(stream())
        version, expected_names = closing()
        return self._close(version, expected_names, seen)

    # -- a sync spread over several calls (one per bucket) --------------------------------
    # The engine gets ONE update_weights call per sync (vLLM reloads whole layers, so it needs
    # every tensor in one call): ``begin`` starts it on a helper thread, reading an iterator
    # that ``load_part`` feeds bucket by bucket (copies: the caller frees its buffer after),
    # and ``finish`` ends the iterator, waits for the engine and checks what arrived.

    def begin(
        self, version: int, *, timeout_s: float = DEFAULT_TIMEOUT_S, again: bool = False
    ) -> None:
        """Start an update to ``version``; generation is refused until ``finish`` succeeds.

        ``timeout_s`` (``weight_sync.timeout_s``) bounds each wait on the engine: taking a
        bucket (``load_part``) and completing the update (``finish``). An engine that does not
        is abandoned - the call raises ``StaleWeightsError`` and the engine refuses to generate.
        ``again``: the retry of a failed sync (``check_announced``).
        """
        self.check_announced(version, again=again)
        self.abandon_sync()
        self.weights_version = None
        self._target = version
        self._seen = []
        self._version_before = self.engine.version
        self._queue = queue.Queue(maxsize=2)
        self._error = None
        self._timeout_s = timeout_s
        self._cancelled = cancelled = threading.Event()
        channel = self._queue

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            while (item := channel.get()) is not _END:
                if cancelled.is_set():
                    raise StaleWeightsError("the weight sync was abandoned")
                if isinstance(item, BaseException):
                    raise item
                yield from item
            if cancelled.is_set():
                raise StaleWeightsError("the weight sync was abandoned")

        def run() -> None:
            try:
                self.engine.update_weights(stream())
            except Exception as error:  # noqa: BLE001 - any failure is re-raised by load_part/finish
                self._error = error

        self._thread = threading.Thread(target=run, name="weight-load", daemon=True)
        self._thread.start()

    def load_part(self, named: Iterable[tuple[str, torch.Tensor]], *, copy: bool = True) -> int:
        """Hand one bucket's tensors to the running update (between ``begin`` and ``finish``).

        ``copy=True`` clones them first (the caller frees its buffer when this returns);
        ``copy=False`` passes them as they are - only for memory that stays unchanged until
        ``finish`` returned (``SharedBucket.stable``), since the engine may read it until then.
        """
        if self._target is None:
            raise StaleWeightsError("load_part outside a sync; call begin(version) first")
        items = [(name, tensor.clone() if copy else tensor) for name, tensor in named]
        self._put(items, "take a bucket")
        self._seen.extend(name for name, _ in items)
        return len(items)

    def _put(self, item: Any, what: str) -> None:
        deadline = time.monotonic() + self._timeout_s
        while True:
            self._raise_engine_error()
            try:
                self._queue.put(item, timeout=min(0.1, max(deadline - time.monotonic(), 0.0)))
                return
            except queue.Full:
                if time.monotonic() >= deadline:
                    self._give_up(what)

    def _give_up(self, what: str) -> None:
        """The engine did not ``what`` within the timeout: abandon the sync and raise."""
        version = self._target
        self._cancel()
        self._target = None
        raise StaleWeightsError(
            f"the engine did not {what} of weights version {version} within "
            f"weight_sync.timeout_s={self._timeout_s:g} s (its update_weights is stuck or slow); "
            "it refuses to generate until a complete sync - raise weight_sync.timeout_s if "
            "loading is just slow, else restart the inference worker"
        )

    def _cancel(self) -> None:
        """Make the running update's stream fail at its next read (it may be blocked on one)."""
        self._cancelled.set()
        try:
            self._queue.put_nowait(_END)  # wakes a stream waiting for the next bucket
        except queue.Full:
            pass  # the stream is not waiting: it sees the flag at its next read

    def _raise_engine_error(self) -> None:
        if self._error is None and self._thread is not None and self._thread.is_alive():
            return
        error = self._error or RuntimeError("update_weights returned before the sync ended")
        self._target = None
        raise StaleWeightsError(
            f"the engine failed while loading weights ({type(error).__name__}: {error}); it "
            "refuses to generate until a complete sync"
        ) from error

    def finish(self, version: int, expected_names: Sequence[str]) -> int:
        """Close the update: every announced tensor arrived and the engine took it.

        Raises ``StaleWeightsError`` otherwise (the engine then keeps refusing to generate).
        """
        target, thread = self._target, self._thread
        if target != version or thread is None:
            self.abandon_sync()
            raise StaleWeightsError(
                f"finish(version={version}) but the running sync began for version {target}; "
                "the engine will not serve until a complete sync"
            )
        self._put(_END, "take the end of the update")
        thread.join(timeout=self._timeout_s)
        if thread.is_alive():
            self._give_up("complete the update")
        self._target = None
        if self._error is not None:
            raise StaleWeightsError(
                f"the engine failed while loading weights version {version} "
                f"({type(self._error).__name__}: {self._error}); it refuses to generate until a "
                "complete sync"
            ) from self._error
        return self._close(version, expected_names, self._seen)

    def abandon_sync(self) -> None:
        """Abandon a running multi-call update: the engine's update fails, nothing is served
        until a full sync.

        Raises ``StaleWeightsError`` when the engine is still stuck in that update after
        ``timeout_s``: a new update beside it would race it for the same weights.
        """
        thread = self._thread
        self._target = None
        if thread is not None and thread.is_alive():
            self._cancel()
            thread.join(timeout=self._timeout_s)
            if thread.is_alive():
                raise StaleWeightsError(
                    "the engine is still stuck in an abandoned weight update after "
                    f"weight_sync.timeout_s={self._timeout_s:g} s; restart the inference worker"
                )
        self._thread = None

    def check_announced(self, version: int, *, again: bool = False) -> None:
        """Raise ``VersionReusedError`` unless ``version`` is newer than any this engine served.

        ``again`` also allows the newest one: the retry of a sync that this engine completed but
        another did not, or the adapters that follow their base in the same version.
        """
        if version > self.last_served or (again and version == self.last_served):
            return
        raise VersionReusedError(
            f"a sync announces weights version {version} but this engine already served "
            f"{self.last_served}; versions only go up - give every WeightSync of a run the run's "
            "PolicyVersion (WeightSync(policy=...)), or restore() it to the checkpoint's version"
        )

    def _close(self, version: int, expected_names: Sequence[str], seen: Sequence[str]) -> int:
        missing = sorted(set(expected_names) - set(seen))
        if missing:
            more = " ..." if len(missing) > 5 else ""
            raise StaleWeightsError(
                f"weight sync to version {version} delivered {len(seen)} of "
                f"{len(expected_names)} tensors (missing {missing[:5]}{more}); the engine will not "
                "serve until a full sync"
            )
        if seen and self.engine.version == self._version_before:
            raise StaleWeightsError(
                f"{type(self.engine).__name__}.update_weights did not bump its version "
                f"({self._version_before}); the engine may not have taken the weights - fix the "
                "engine's update_weights"
            )
        self.weights_version = self.last_served = version
        return version

    def load_adapter(self, adapter: AdapterWeights, *, version: int) -> int:
        """Serve the engine's base with ``adapter`` (LoRA) as ``version``; generation is refused
        while it loads, and after a failed load until a later sync completes."""
        self.check_announced(version, again=True)
        self.abandon_sync()
        self.weights_version = None
        before = self.engine.version
        self.engine.load_adapter(adapter)
        if self.engine.version == before:
            raise StaleWeightsError(
                f"{type(self.engine).__name__}.load_adapter did not bump its version ({before}); "
                "fix the engine's load_adapter"
            )
        self.weights_version = self.last_served = version
        return version

    def check(self, expected: int | None = None) -> int:
        """The served version; raises ``StaleWeightsError`` if half-updated or not ``expected``."""
        if self.weights_version is None:
            raise StaleWeightsError(
                "this engine's weights are half-updated (a sync is running or failed); run a "
                "complete weight sync before generating"
            )
        if expected is not None and self.weights_version != expected:
            raise StaleWeightsError(
                f"engine serves weights version {self.weights_version}, "
                f"the trainer is at {expected}"
            )
        return self.weights_version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        version = self.check()
        result = await self.engine.generate(request)
        result.policy_version = version
        return result

    def generate_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """The engine's blocking batch call, refused while half-updated.

        Results carry ``weights_version`` as their ``policy_version``.
        """
        version = self.check()
        results = self.engine.generate_batch(requests)
        for result in results:
            result.policy_version = version
        return results

    def __getattr__(self, name: str) -> Any:
        # anything else the wrapped engine offers (num_unfinished, close, shutdown, model, ...)
        if name in ("engine", "weights_version") or name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.engine, name)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def update_weights(self, weights: Any) -> None:
        """Direct (unbucketed) update: announced as one version higher than the served one."""
        items = list(weights.items() if isinstance(weights, Mapping) else weights)
        self.load(
            [_NamedTensors(items)],
            version=self.last_served + 1,
            expected_names=[name for name, _ in items],
        )

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def get_state(self) -> dict[str, Any]:
        return {**self.engine.get_state(), "weights_version": self.weights_version}

    def set_state(self, state: dict[str, Any]) -> None:
        self.engine.set_state(state)
        self.weights_version = state.get("weights_version", self.weights_version)
        if self.weights_version is not None:  # a restore: the one way a version goes back
            self.last_served = self.weights_version


class _NamedTensors:
    """A direct update's tensors as one :class:`TensorSource`."""

    def __init__(self, items: list[tuple[str, torch.Tensor]]) -> None:
        self.items = items

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.items


def confirm_versions(versions: Sequence[int | None], expected: int) -> None:
    """The trainer's check after a sync: every engine serves ``expected``.

    Otherwise ``StaleWeightsError`` names the engines that do not, and what they serve.
    """
    bad = [(i, v) for i, v in enumerate(versions) if v != expected]
    if bad:
        raise StaleWeightsError(
            f"after syncing version {expected}, engines {[i for i, _ in bad]} serve "
            f"{[v for _, v in bad]} (None: half-updated); rerun the sync, or restart those engines"
        )
