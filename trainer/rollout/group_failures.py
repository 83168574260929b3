"""When failed groups stop a run: ``GroupFailures``, the scheduler's count per env.

A group fails when one of its episodes still failed after its replays (``groups.play_episode``);
the scheduler replaces it. Failures are counted per env id, in a row: a group of the env that
does not fail resets its count. Per env, so that an env of a mix that always fails (a missing
dataset file, a bad kwarg) cannot hide behind the others' successes: its first failed group is
logged as a warning naming it and the reason, and the run stops once ``limit`` of its groups
failed in a row, with a ``RolloutError`` that names it (and says where to look).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence

from trainer.errors import RolloutError
from trainer.rollout.groups import failure_hint

__all__ = ["GroupFailures"]

_log = logging.getLogger(__name__)


class GroupFailures:
    """Failed groups in a row per env id (see the module docstring).

    ``limit``: groups of one env failed in a row that stop the run; ``max_retries``: the
    replays of an episode (said in the error); ``mix``: the run plays several envs."""

    def __init__(self, limit: int, *, max_retries: int, mix: bool) -> None:
        self.limit, self.max_retries, self.mix = limit, max_retries, mix
        self.in_a_row: collections.Counter[str] = collections.Counter()
        """Per env id: its groups that failed since its last group that did not."""
        self._warned: set[str] = set()

    def failed(self, env_id: str, reason: str | None) -> None:
        """A group of ``env_id`` failed (``reason``: its last failed episode's)."""
        self.in_a_row[env_id] += 1
        if env_id not in self._warned:
            self._warned.add(env_id)
            _log.warning(
                "env %s: a group failed every retry and was replaced (%s); the run stops after "
                "%d of its groups fail in a row",
                env_id,
                reason or "unknown",
                self.limit,
            )

    def succeeded(self, env_id: str) -> None:
        """A group of ``env_id`` did not fail."""
        self.in_a_row[env_id] = 0

    def stopping(self) -> str | None:
        """The env whose groups failed ``limit`` times in a row, if one did."""
        for env_id, count in self.in_a_row.items():
            if count >= self.limit:
                return env_id
        return None

    def error(self, env_id: str, failures: Sequence[str]) -> RolloutError:
        """Why the run stops (``failures``: the env's latest failure reasons): the inference
        engine when every one is an engine error (every engine failing), else the env."""
        reasons = sorted(set(failures))[:3]
        which = f" of env {env_id!r}" if self.mix else ""  # (one env: the reasons name it)
        head = (
            f"{self.in_a_row[env_id]} groups{which} in a row failed (an episode is retried up "
            f"to {self.max_retries} times); first reasons: {reasons}."
        )
        if failures and all(f.startswith("engine error") for f in failures):
            return RolloutError(
                f"{head} An inference engine is failing (every engine behind the router: one "
                "that still answers gets the episodes): read the engine's log (vLLM/CUDA "
                "errors), fix or restart it, and resume from the last checkpoint"
            )
        return RolloutError(f"{head} {failure_hint(failures, [env_id])}")
