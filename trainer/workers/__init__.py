"""The role workers and their typed clusters: ``actor`` (actor_train), ``infer`` (actor_infer),
``reference``, ``critic`` and ``reward``. Each worker holds a strategy or engine from
``trainer.strategies`` and exposes ``@register``-ed methods; each cluster subclass wraps those
methods in typed calls (``remote(Worker.method)``) the pipeline reads like prose;
``strategy_worker`` is what the actor, critic and reference workers share."""

from __future__ import annotations

__all__ = ["actor", "critic", "infer", "reference", "reward", "strategy_worker"]
