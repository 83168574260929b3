"""The environment registry: ids, specs, ``register``/``make``/``spec``/``list_envs``.

Ids read ``namespace/name-vN`` (``games/sokoban-v0``). A registration may declare
*variants* (sizes, difficulty): ``register("games/sokoban-v0", ..., variants={"8x8":
{"size": 8}})`` also registers ``games/sokoban-8x8-v0`` with those kwargs layered on top.

Discovery is lazy: the first lookup loads envhub's built-in environments and then every
third-party plugin in the ``envhub.envs`` entry-point group. A plugin is a callable that
calls ``envhub.register``; in the plugin's ``pyproject.toml``::

    [project.entry-points."envhub.envs"]
    acme = "acme_envs:register"

A plugin that fails to load is reported (a warning, ``plugin_errors()``, and a footer in
``envhub list``) and never stops the others. Every registered id is mirrored into
Gymnasium's registry, so after any envhub lookup (or ``load_plugins()``) ``gymnasium.make``
accepts the same ids.
"""

from __future__ import annotations

import contextvars
import difflib
import importlib
import importlib.metadata
import inspect
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from envhub.errors import EnvKwargsError, RegistrationError, UnknownEnvError

__all__ = [
    "ENTRY_POINT_GROUP",
    "EnvSpec",
    "PluginFailure",
    "Registry",
    "import_target",
    "list_envs",
    "load_plugins",
    "make",
    "note_namespace",
    "plugin_errors",
    "register",
    "registry",
    "spec",
]

ENTRY_POINT_GROUP = "envhub.envs"
BUILTIN_PLUGINS: dict[str, str] = {
    "envhub.games": "envs.games:register",
    "envhub.tools": "envs.tools:register",
    "envhub.web": "envs.web:register",
    "envhub.code": "envs.code:register",
}
"""envhub's own environment packages, loaded before third-party plugins."""

SLOW_PLUGIN_SECONDS = 5.0
"""A plugin still loading after this long is named on stderr (it may hang every command)."""

_ID = re.compile(
    r"^(?P<ns>[a-z0-9][a-z0-9_.-]*)/(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]*?)-v(?P<version>\d+)$"
)
_VARIANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.]*$")


def import_target(path: str) -> Any:
    """The object a ``"module:attr.sub"`` path names (``"module"`` alone: the module); raises
    ``ImportError``/``AttributeError``."""
    module_name, _, attr = path.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in filter(None, attr.split(".")):
        target = getattr(target, part)
    return target


def _parse_id(env_id: str) -> tuple[str, str, int]:
    match = _ID.match(env_id) if isinstance(env_id, str) else None
    if match is None:
        raise RegistrationError(
            f"malformed environment id {env_id!r}: use 'namespace/name-vN', "
            "e.g. 'acme/maze-v0' (a lower-case namespace, a version suffix -v0, -v1, ...)"
        )
    return match["ns"], match["name"], int(match["version"])


@dataclass(frozen=True)
class EnvSpec:
    """Everything needed to build one registered environment."""

    id: str
    entry_point: str | Callable[..., Any]
    """``"module:attr"`` (imported only when the env is made) or a callable."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Default constructor kwargs; ``make(id, **overrides)`` layers on top."""
    max_turns: int | None = None
    """Passed as ``max_turns`` when the env accepts it and the caller gave none."""
    description: str = ""
    family: str = ""
    """The id this spec was registered under; variants share their family's id."""
    variant: str | None = None
    source: str = field(default="user", compare=False)
    """Who registered it: ``envhub.games``, a plugin's entry-point name, or ``user``."""

    @property
    def namespace(self) -> str:
        return _parse_id(self.id)[0]

    @property
    def name(self) -> str:
        return _parse_id(self.id)[1]

    @property
    def version(self) -> int:
        return _parse_id(self.id)[2]

    def load_entry_point(self) -> Callable[..., Any]:
        """Import and return the callable that builds the env."""
        if callable(self.entry_point):
            return self.entry_point
        try:
            target = import_target(self.entry_point)
        except (ImportError, AttributeError) as exc:
            raise RegistrationError(
                f"{self.id}: cannot load entry point {self.entry_point!r} ({exc}); "
                "check the module path and attribute name given to register()"
            ) from exc
        return target

    def accepted_kwargs(self) -> list[str] | None:
        """Keyword arguments the entry point accepts, or ``None`` if it takes any.

        For a class whose ``__init__`` forwards ``**kwargs`` to its parent (the usual
        ``super().__init__(**kwargs)``), the parents' parameters are followed up the MRO.
        """
        target = self.load_entry_point()
        initialisers: list[Callable[..., Any]] = []
        if inspect.isclass(target):
            initialisers = [
                k.__dict__["__init__"]
                for k in target.__mro__
                if "__init__" in k.__dict__ and k is not object
            ]
        else:
            initialisers = [target]
        names: list[str] = []
        for initialiser in initialisers:
            forwards = False
            for parameter in inspect.signature(initialiser).parameters.values():
                by_name = parameter.kind in (
                    inspect.Parameter.KEYWORD_ONLY,
                    inspect.Parameter.POSITIONAL_OR_KEYWORD,
                )
                if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                    forwards = True
                elif by_name and parameter.name != "self" and parameter.name not in names:
                    names.append(parameter.name)
            if not forwards:
                return names
        return None if not inspect.isclass(target) else names

    def make(self, **kwargs: Any) -> Any:
        """Build the environment with this spec's kwargs overridden by ``kwargs``."""
        env = self.load_entry_point()(**self.constructor_kwargs(kwargs))
        _attach_gymnasium_spec(env, self, kwargs)
        return env

    def constructor_kwargs(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """What ``make(**overrides)`` passes the entry point: this spec's kwargs, ``overrides``
        on top, and ``max_turns`` where accepted; raises ``EnvKwargsError`` naming any key the
        entry point does not accept."""
        merged = {**self.kwargs, **overrides}
        accepted = self.accepted_kwargs()
        if (
            self.max_turns is not None
            and "max_turns" not in merged
            and (accepted is None or "max_turns" in accepted)
        ):
            merged["max_turns"] = self.max_turns
        if accepted is not None:
            unknown = sorted(set(merged) - set(accepted))
            if unknown:
                hints = []
                for key in unknown:
                    close = difflib.get_close_matches(key, accepted, n=1)
                    if close:
                        hints.append(f"{key!r} -> did you mean {close[0]!r}?")
                hint = f" ({'; '.join(hints)})" if hints else ""
                raise EnvKwargsError(
                    f"{self.id} got unexpected keyword argument(s) "
                    f"{', '.join(repr(k) for k in unknown)}{hint}; "
                    f"it accepts: {', '.join(accepted) or '(none)'}"
                )
        return merged


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be loaded, and why."""

    name: str
    target: str
    error: str


class Registry:
    """A set of ``EnvSpec`` keyed by id, with lazy plugin discovery.

    The module-level functions use one shared instance, ``registry``; tests may build
    their own with ``discover=False``.
    """

    def __init__(self, *, discover: bool = True) -> None:
        self._specs: dict[str, EnvSpec] = {}
        self._failures: list[PluginFailure] = []
        self._namespace_notes: dict[str, str] = {}
        self._discovered = not discover
        self._loading: str | None = None
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ registration
    def register(
        self,
        id: str,
        entry_point: str | Callable[..., Any],
        *,
        kwargs: dict[str, Any] | None = None,
        max_turns: int | None = None,
        description: str = "",
        variants: dict[str, dict[str, Any]] | None = None,
        override: bool = False,
    ) -> EnvSpec:
        """Register an environment (and its variants); return the family's spec.

        Re-registering an identical spec is a no-op; a different spec under a taken id is
        refused unless ``override=True``.
        """
        namespace, name, version = _parse_id(id)
        if not (callable(entry_point) or (isinstance(entry_point, str) and ":" in entry_point)):
            raise RegistrationError(
                f"{id}: entry_point must be 'module:ClassName' or a callable, got {entry_point!r}"
            )
        if max_turns is not None and (not isinstance(max_turns, int) or max_turns < 1):
            raise RegistrationError(f"{id}: max_turns must be a positive int, got {max_turns!r}")
        base = EnvSpec(
            id=id,
            entry_point=entry_point,
            kwargs=dict(kwargs or {}),
            max_turns=max_turns,
            description=description,
            family=id,
            source=self._loading or "user",
        )
        specs = [base]
        for variant, overrides in (variants or {}).items():
            if not _VARIANT.match(variant):
                raise RegistrationError(
                    f"{id}: variant name {variant!r} must be letters, digits, '_' or '.' (e.g. "
                    "'8x8', 'hard')"
                )
            specs.append(
                replace(
                    base,
                    id=f"{namespace}/{name}-{variant}-v{version}",
                    kwargs={**base.kwargs, **overrides},
                    variant=variant,
                )
            )
        with self._lock:
            for new in specs:
                old = self._specs.get(new.id)
                if old is not None and old != new and not override:
                    raise RegistrationError(
                        f"{new.id} is already registered (by {old.source}, entry point "
                        f"{old.entry_point!r}); choose another id or version, or pass override=True"
                    )
            for new in specs:
                old = self._specs.get(new.id)
                if old is not None and old != new and self._loading not in (None, old.source):
                    warnings.warn(
                        f"envhub: the plugin {new.source!r} replaces {new.id} (registered by "
                        f"{old.source!r}) with entry point {new.entry_point!r}",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                self._specs[new.id] = new
                _mirror_to_gymnasium(new)
        return base

    # ------------------------------------------------------------------ discovery
    def load_plugins(self) -> list[PluginFailure]:
        """Load built-in envs and ``envhub.envs`` entry points once; return the failures."""
        with self._lock:
            if self._discovered:
                return list(self._failures)
            self._discovered = True
            targets = list(BUILTIN_PLUGINS.items())
            for entry in self._entry_points():
                if entry.value not in dict(targets).values():
                    targets.append((entry.name, entry.value))
            for name, target in targets:
                self._load_one(name, target)
            return list(self._failures)

    def _entry_points(self) -> list[importlib.metadata.EntryPoint]:
        """The ``envhub.envs`` entry points of the installed distributions."""
        try:
            return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
        except Exception:  # noqa: BLE001 - some package's entry_points.txt is malformed
            return self._entry_points_one_by_one()

    def _entry_points_one_by_one(self) -> list[importlib.metadata.EntryPoint]:
        """``_entry_points`` read from each distribution in turn (the first of a name on the
        path, as ``entry_points`` takes): one whose entry points cannot be read is a failure
        naming it, and the others still count."""
        found: list[importlib.metadata.EntryPoint] = []
        seen: set[str] = set()
        for distribution in importlib.metadata.distributions():
            where = name = str(getattr(distribution, "_path", distribution))
            try:
                name = distribution.metadata["Name"] or where
                key = re.sub(r"[-_.]+", "-", name).lower()
                if key in seen:
                    continue
                seen.add(key)
                found += [e for e in distribution.entry_points if e.group == ENTRY_POINT_GROUP]
            except Exception as exc:  # noqa: BLE001 - one broken package must not hide the rest
                self._fail(
                    PluginFailure(
                        name=name,
                        target=where,
                        error=(
                            f"its entry_points.txt cannot be read ({type(exc).__name__}: {exc})"
                        ),
                    )
                )
        return found

    def _load_one(self, name: str, target: str) -> None:
        self._loading = name
        token = _ACTIVE.set(self)  # the plugin's envhub.register() calls land here
        before = dict(self._specs)
        slow = threading.Timer(SLOW_PLUGIN_SECONDS, _say_slow, (name, target))
        slow.daemon = True
        slow.start()
        try:
            plugin = import_target(target)
            if callable(plugin):
                plugin()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - a broken plugin must not break the others
            self._specs = before  # none of its ids, as the failure says (even those registered)
            error = f"{type(exc).__name__}: {exc}"
            self._fail(PluginFailure(name=name, target=target, error=error))
        finally:
            slow.cancel()
            _ACTIVE.reset(token)
            self._loading = None

    def _fail(self, failure: PluginFailure) -> None:
        self._failures.append(failure)
        warnings.warn(
            f"envhub: plugin {failure.name!r} ({failure.target}) failed to load and its "
            f"environments are unavailable: {failure.error}. Fix or uninstall the package that "
            "provides it.",
            RuntimeWarning,
            stacklevel=4,
        )

    def plugin_errors(self) -> list[PluginFailure]:
        self.load_plugins()
        return list(self._failures)

    def note_namespace(self, namespace: str, note: str) -> None:
        """Say why a namespace holds no ids (e.g. ``textarena``: its package is not installed).

        Unknown ids under ``namespace`` get ``note`` in their error, and ``envhub list`` shows
        it, so a user who follows a README's ``textarena/...`` id learns which extra to install
        instead of a bare "no environment registered".
        """
        self._namespace_notes[namespace] = note

    def namespace_notes(self) -> dict[str, str]:
        """Notes left by ``note_namespace``: namespace -> why it holds no ids."""
        self.load_plugins()
        return dict(self._namespace_notes)

    # ------------------------------------------------------------------ lookup
    def spec(self, id: str) -> EnvSpec:
        """The spec registered under ``id``; the namespace may be left out when unambiguous."""
        self.load_plugins()
        found = self._specs.get(id)
        if found is not None:
            return found
        if isinstance(id, str) and "/" not in id:
            matches = [s for s in self._specs.values() if s.id.split("/", 1)[1] == id]
            if len(matches) == 1:
                return matches[0]
            if matches:
                raise UnknownEnvError(
                    f"{id!r} is ambiguous: it is {' or '.join(sorted(s.id for s in matches))}; "
                    "give the full id"
                )
        raise UnknownEnvError(self._unknown_message(id))

    def _unknown_message(self, id: str) -> str:
        known = sorted(self._specs)
        message = f"no environment registered under {id!r}."
        note = self._namespace_notes.get(id.split("/", 1)[0]) if isinstance(id, str) else None
        if note is not None:
            return f"{message} {note}"
        if isinstance(id, str):
            short = {k.split("/", 1)[1]: k for k in known}
            close = difflib.get_close_matches(id, known, n=3, cutoff=0.6)
            close += [
                short[m]
                for m in difflib.get_close_matches(id.split("/")[-1], list(short), n=3, cutoff=0.6)
            ]
            close = list(dict.fromkeys(close))[:3]
            if close:
                message += f" Did you mean {' or '.join(repr(c) for c in close)}?"
        message += " Run `envhub list` to see every id"
        if self._failures:
            message += f" ({len(self._failures)} plugin(s) failed to load; see `envhub list`)"
        return message + "."

    def make(self, id: str, **kwargs: Any) -> Any:
        """Build the environment registered under ``id`` with ``kwargs`` overriding defaults."""
        return self.spec(id).make(**kwargs)

    def list_envs(self, namespace: str | None = None, *, variants: bool = True) -> list[EnvSpec]:
        """Every registered spec, sorted by id; optionally one namespace, no variants."""
        self.load_plugins()
        specs = sorted(self._specs.values(), key=lambda s: s.id)
        return [
            s
            for s in specs
            if (namespace is None or s.namespace == namespace) and (variants or s.variant is None)
        ]

    def __contains__(self, id: object) -> bool:
        self.load_plugins()
        return id in self._specs

    def __iter__(self) -> Iterator[str]:
        return iter(s.id for s in self.list_envs())

    def __len__(self) -> int:
        return len(self.list_envs())


_GYMNASIUM_ENTRY = "envhub.registry:_make_for_gymnasium"


def _make_for_gymnasium(envhub_id: str, **kwargs: Any) -> Any:
    """What ``gymnasium.make`` calls for an envhub id (a string entry point, so picklable)."""
    return registry.make(envhub_id, **kwargs)


def _mirror_to_gymnasium(spec: EnvSpec) -> None:
    """Register ``spec`` with Gymnasium too, so ``gymnasium.make(spec.id)`` works."""
    import gymnasium

    if spec.id not in gymnasium.registry:
        gymnasium.register(id=spec.id, entry_point=_GYMNASIUM_ENTRY, kwargs={"envhub_id": spec.id})


def _attach_gymnasium_spec(env: Any, spec: EnvSpec, overrides: dict[str, Any]) -> None:
    """Give the env a Gymnasium ``spec`` that rebuilds it (``gymnasium.make(env.spec)``)."""
    import gymnasium

    unwrapped = getattr(env, "unwrapped", None)
    if unwrapped is None:
        return
    try:
        unwrapped.spec = gymnasium.envs.registration.EnvSpec(
            id=spec.id, entry_point=_GYMNASIUM_ENTRY, kwargs={"envhub_id": spec.id, **overrides}
        )
    except AttributeError:  # a read-only spec property on some custom env
        pass


def _say_slow(name: str, target: str) -> None:
    print(
        f"envhub: loading plugin {name!r} ({target}) is taking long (over "
        f"{SLOW_PLUGIN_SECONDS:g} s); if it hangs, fix or uninstall the package that provides it",
        file=sys.stderr,
        flush=True,
    )


registry = Registry()
_ACTIVE: contextvars.ContextVar[Registry | None] = contextvars.ContextVar(
    "envhub_active_registry", default=None
)
"""The registry whose plugins are loading; plugins' ``register()`` calls go to it."""


def register(id: str, entry_point: str | Callable[..., Any], **options: Any) -> EnvSpec:
    """Register an environment in the shared registry (see ``Registry.register``)."""
    active = _ACTIVE.get()
    return (registry if active is None else active).register(id, entry_point, **options)


def note_namespace(namespace: str, note: str) -> None:
    """Say why ``namespace`` holds no ids (see ``Registry.note_namespace``); for plugins."""
    active = _ACTIVE.get()
    (registry if active is None else active).note_namespace(namespace, note)


def make(id: str, *, hub: str | None = None, **kwargs: Any) -> Any:
    """Build a registered environment: ``envhub.make("games/sokoban-v0", size=8)``.

    With ``hub="ws://host:port"`` (and ``token=...``), return an ``envhub.client.RemoteEnv``
    whose episodes run on that hub instead.
    """
    if hub is not None:
        from envhub.client import RemoteEnv

        return RemoteEnv(id, hub, **kwargs)
    return registry.make(id, **kwargs)


def spec(id: str) -> EnvSpec:
    """The ``EnvSpec`` registered under ``id``."""
    return registry.spec(id)


def list_envs(namespace: str | None = None, *, variants: bool = True) -> list[EnvSpec]:
    """Every registered ``EnvSpec``, sorted by id."""
    return registry.list_envs(namespace, variants=variants)


def load_plugins() -> list[PluginFailure]:
    """Discover built-in and plugin environments now (normally done on first use)."""
    return registry.load_plugins()


def plugin_errors() -> list[PluginFailure]:
    """Plugins that failed to load, with the error each raised."""
    return registry.plugin_errors()
