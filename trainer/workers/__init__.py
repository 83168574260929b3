"""The role workers and their typed clusters: ``actor`` (actor_train), ``infer`` (actor_infer),
``reference``, ``critic`` and ``reward``. Each worker holds a strategy or engine from
``trainer.strategies`` and exposes ``@register``-ed methods; each cluster subclass wraps those
methods in typed calls the pipeline reads like prose."""

from __future__ import annotations

__all__ = ["actor", "critic", "infer", "reference", "reward"]
