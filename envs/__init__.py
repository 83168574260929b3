"""envhub's built-in environments: ``games/``, and later ``code/``, ``web/`` and ``tools/``.

Each subpackage exposes ``register()``, which the registry calls on first use.
"""
