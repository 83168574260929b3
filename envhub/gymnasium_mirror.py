"""Every envhub id in Gymnasium's registry too, so ``gymnasium.make`` builds the same envs.

The registry calls ``mirror`` for each spec it registers and ``attach_spec`` for each env it
makes. Gymnasium's entry point is the string ``ENTRY`` (so specs pickle and reach other
processes), which names ``make``: it builds through envhub's registry, so Gymnasium gets the
env the envhub id names today, with its kwargs and ``max_turns``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from envhub.registry import EnvSpec

__all__ = ["ENTRY", "attach_spec", "make", "mirror"]

ENTRY = "envhub.gymnasium_mirror:make"


def make(envhub_id: str, **kwargs: Any) -> Any:
    """What ``gymnasium.make`` calls for an envhub id."""
    from envhub.registry import registry

    return registry.make(envhub_id, **kwargs)


def mirror(spec: EnvSpec) -> None:
    """Register ``spec`` with Gymnasium too, so ``gymnasium.make(spec.id)`` works."""
    import gymnasium

    if spec.id not in gymnasium.registry:
        gymnasium.register(id=spec.id, entry_point=ENTRY, kwargs={"envhub_id": spec.id})


def attach_spec(env: Any, spec: EnvSpec, overrides: dict[str, Any]) -> None:
    """Give the env a Gymnasium ``spec`` that rebuilds it (``gymnasium.make(env.spec)``)."""
    import gymnasium

    unwrapped = getattr(env, "unwrapped", None)
    if unwrapped is None:
        return
    try:
        unwrapped.spec = gymnasium.envs.registration.EnvSpec(
            id=spec.id, entry_point=ENTRY, kwargs={"envhub_id": spec.id, **overrides}
        )
    except AttributeError:  # a read-only spec property on some custom env
        pass
