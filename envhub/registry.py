"""The environment registry: ids, specs, ``register``/``make``/``spec``/``list_envs``.

Ids read ``namespace/name-vN`` (``games/sokoban-v0``). A registration may declare
*variants* (sizes, difficulty): ``register("games/sokoban-v0", ..., variants={"8x8":
{"size": 8}})`` also registers ``games/sokoban-8x8-v0`` with those kwargs layered on top.

Discovery is lazy: the first lookup loads envhub's built-in environments and then every
third-party plugin in the ``envhub.envs`` entry-point group. A plugin is a callable that
calls ``envhub.register``; in the plugin's ``pyproject.toml``::

    [project.entry-points."envhub.envs"]
    acme = "acme_envs:register"

Modules named in ``ENVHUB_PLUGINS`` (the CLI's ``--import MODULE`` adds to it) load after
them, the same way (``envhub.plugins``): so ids a script registers reach the CLI and its workers.

A plugin that fails to load is reported (a warning, ``plugin_errors()``, and a footer in
``envhub list``) and never stops the others. Each id a plugin registers stands alone: an id
that collides with another registration is kept out and reported, and the plugin's other ids
load. Nobody owns a namespace, and no plugin may take another's id: an id two plugins register
is refused for both (install order must not pick the env), and using it is an error naming
both packages; a built-in or a run-time ``register()`` keeps its id unless the plugin passes
``override=True`` (warned). Using any id of a namespace where a plugin failed or collided
warns, naming the problem. Every registered id is mirrored into Gymnasium's registry
(``envhub.gymnasium_mirror``), so after any envhub lookup (or ``load_plugins()``)
``gymnasium.make`` accepts the same ids.
"""

from __future__ import annotations

import contextvars
import difflib
import importlib
import numbers
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from envhub import gymnasium_mirror
from envhub.errors import EnvKwargsError, RegistrationError, UnknownEnvError
from envhub.plugins import (
    PLUGINS_VARIABLE,
    PYTHON_IDS_HINT,
    SLOW_PLUGIN_SECONDS,
    PluginFailure,
    installed_entry_points,
    say_slow,
    search_current_folder,
    variable_plugins,
)
from envhub.signatures import accepted_keywords

__all__ = [
    "ENTRY_POINT_GROUP",
    "EnvSpec",
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


def _turn_limit(id: str, kwargs: dict[str, Any], max_turns: Any) -> int | None:
    """The ``max_turns`` a spec builds with: its kwargs' when they hold one (``make`` passes
    them as given), else the registered one, as an ``int``; a ``RegistrationError`` unless a
    positive whole number (``numbers.Integral`` such as ``numpy.int64``, not ``bool``)."""
    value = kwargs.get("max_turns", max_turns)
    if value is None:
        return None
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise RegistrationError(f"{id}: max_turns must be a positive int, got {value!r}")
    return int(value)


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
    """The turn limit ``make(id)`` builds with (``kwargs["max_turns"]`` where the kwargs hold
    one, a variant's included); passed as ``max_turns`` when the env accepts it and neither the
    kwargs nor the caller give one. ``None``: the env picks its own."""
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
        """Keyword arguments the entry point accepts, or ``None`` if it takes any (read from
        its signatures: ``envhub.signatures``)."""
        return accepted_keywords(self.load_entry_point())[0]

    def make(self, **kwargs: Any) -> Any:
        """Build the environment with this spec's kwargs overridden by ``kwargs``."""
        env = self.load_entry_point()(**self.constructor_kwargs(kwargs))
        gymnasium_mirror.attach_spec(env, self, kwargs)
        return env

    def constructor_kwargs(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """What ``make(**overrides)`` passes the entry point: this spec's kwargs, ``overrides``
        on top, and ``max_turns`` where accepted; raises ``EnvKwargsError`` naming any key the
        entry point does not accept."""
        merged = {**self.kwargs, **overrides}
        accepted, inferred = accepted_keywords(self.load_entry_point())
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
                how = (
                    " (read from the signatures of its __init__ and of the parents it passes "
                    "**kwargs to; if it takes other keywords, register a function that takes "
                    "**kwargs and builds the env as its entry point)"
                    if inferred
                    else ""
                )
                raise EnvKwargsError(
                    f"{self.id} got unexpected keyword argument(s) "
                    f"{', '.join(repr(k) for k in unknown)}{hint}; "
                    f"it accepts: {', '.join(accepted) or '(none)'}{how}"
                )
        return merged


class Registry:
    """A set of ``EnvSpec`` keyed by id, with lazy plugin discovery.

    The module-level functions use one shared instance, ``registry``; tests may build
    their own with ``discover=False``.
    """

    def __init__(self, *, discover: bool = True) -> None:
        self._specs: dict[str, EnvSpec] = {}
        self._contested: dict[str, list[EnvSpec]] = {}  # id -> the plugins' specs: all refused
        self._failures: list[PluginFailure] = []
        self._namespace_notes: dict[str, str] = {}
        self._origins: dict[str, str] = {}
        """A plugin's name -> where it comes from (``package acme-envs``), for messages."""
        self._loaded: set[str] = set()
        self._warned: set[str] = set()
        self._discovered = not discover
        self._loading: str | None = None
        self._loading_target = ""
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
        family = dict(kwargs or {})
        base = EnvSpec(
            id=id,
            entry_point=entry_point,
            kwargs=family,
            max_turns=_turn_limit(id, family, max_turns),
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
            variant_id, merged = f"{namespace}/{name}-{variant}-v{version}", {**family, **overrides}
            changes = ", ".join(f"{key}={value}" for key, value in overrides.items())
            specs.append(
                replace(
                    base,
                    id=variant_id,
                    kwargs=merged,
                    max_turns=_turn_limit(variant_id, merged, max_turns),
                    description=f"{description} Variant {variant}: {changes}.".lstrip(),
                    variant=variant,
                )
            )
        with self._lock:
            for new in specs:  # (a plugin's clash with its own ids fails the whole plugin)
                old = self._specs.get(new.id)
                mine = self._loading is None or (old is not None and old.source == self._loading)
                if old is not None and old != new and not override and mine:
                    raise RegistrationError(
                        f"{new.id} is already registered (by {old.source}, entry point "
                        f"{old.entry_point!r}); choose another id or version, or pass override=True"
                    )
            for new in specs:
                if self._loading is None:
                    self._contested.pop(new.id, None)  # this process chose, on purpose
                    self._put(new)
                else:
                    self._claim(new, override=override)
        return base

    def _put(self, spec: EnvSpec) -> None:
        self._specs[spec.id] = spec
        gymnasium_mirror.mirror(spec)

    def _claim(self, new: EnvSpec, *, override: bool) -> None:
        """Register a loading plugin's spec, unless another registration holds its id."""
        old = self._specs.get(new.id)
        claimants = self._contested.get(new.id)
        if claimants is not None:
            if all(c.source != new.source for c in claimants):
                claimants.append(new)
                self._refuse(new.id, self._contested_message(new.id))
        elif old is None or old == new or old.source == new.source:
            self._put(new)
        elif old.source == "user" or old.source in BUILTIN_PLUGINS:
            if override:
                warnings.warn(
                    f"envhub: the plugin {new.source!r} replaces {new.id} (registered by "
                    f"{old.source!r}) with entry point {new.entry_point!r}",
                    RuntimeWarning,
                    stacklevel=4,
                )
                self._put(new)
                return
            self._refuse(
                new.id,
                f"{new.id} is already registered by {self._who(old)}, so this plugin's "
                "registration of it is refused (its other ids are loaded); choose another id or "
                "version, or pass override=True to replace it on purpose",
            )
        else:  # two third-party plugins: refused for both, so install order picks nothing
            del self._specs[new.id]
            self._contested[new.id] = [old, new]
            self._refuse(new.id, self._contested_message(new.id))

    def _refuse(self, id: str, error: str) -> None:
        self._fail(PluginFailure(self._loading or "", self._loading_target, error, (id,), True))

    def _contested_message(self, id: str) -> str:
        names = [self._who(c) for c in self._contested[id]]
        listed = ", ".join(names[:-1]) + f" and {names[-1]}"
        return (
            f"{id} is registered by {len(names)} plugins, {listed}; envhub refuses it for all of "
            "them rather than let the install order pick one. Keep one (uninstall the package, "
            "or drop the module from --import / ENVHUB_PLUGINS), or rename the id in one of them"
        )

    def _who(self, spec: EnvSpec) -> str:
        origin = self._origins.get(spec.source, "registered at run time")
        return f"{spec.source!r} ({origin}, entry point {spec.entry_point!r})"

    # ------------------------------------------------------------------ discovery
    def load_plugins(self) -> list[PluginFailure]:
        """Load built-in envs and ``envhub.envs`` entry points once; return the failures."""
        with self._lock:
            if self._discovered:
                return list(self._failures)
            self._discovered = True
            targets = list(BUILTIN_PLUGINS.items())
            self._origins.update((name, "envhub's own") for name in BUILTIN_PLUGINS)
            for entry in installed_entry_points(ENTRY_POINT_GROUP, self._fail):
                if entry.value not in dict(targets).values():
                    targets.append((entry.name, entry.value))
                    dist = getattr(entry, "dist", None)
                    self._origins[entry.name] = f"package {getattr(dist, 'name', '?')}"
            variable = variable_plugins()
            if variable:
                search_current_folder()
            for name, target in variable:
                if target not in dict(targets).values():
                    targets.append((name, target))
            for name, target in targets:
                self._load_one(name, target)
            return list(self._failures)

    def load_more(self, targets: Sequence[tuple[str, str]]) -> list[PluginFailure]:
        """Load more ``(name, "module[:func]")`` plugins now (``import_plugins``), once each;
        return their failures (collisions included)."""
        with self._lock:
            if not self._discovered:
                self.load_plugins()  # (which loads ENVHUB_PLUGINS, where they are named)
            search_current_folder()
            for name, target in targets:
                if target not in self._loaded:
                    self._load_one(name, target)
            wanted = {target for _, target in targets}
            return [f for f in self._failures if f.target in wanted]

    def _load_one(self, name: str, target: str) -> None:
        self._loading, self._loading_target = name, target
        self._loaded.add(target)
        self._origins.setdefault(name, f"--import or {PLUGINS_VARIABLE}")
        token = _ACTIVE.set(self)  # the plugin's envhub.register() calls land here
        before = (dict(self._specs), {k: list(v) for k, v in self._contested.items()})
        failed_before = len(self._failures)
        slow = threading.Timer(SLOW_PLUGIN_SECONDS, say_slow, (name, target))
        slow.daemon = True
        slow.start()
        try:
            plugin = import_target(target)
            if callable(plugin):
                plugin()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - a broken plugin must not break the others
            dropped = tuple(sorted(set(self._specs) - set(before[0])))
            # none of its ids, as the failure says (even those registered), nor its collisions
            self._specs, self._contested = before
            del self._failures[failed_before:]
            error = f"{type(exc).__name__}: {exc}"
            self._fail(PluginFailure(name=name, target=target, error=error, ids=dropped))
        finally:
            slow.cancel()
            _ACTIVE.reset(token)
            self._loading = None

    def _fail(self, failure: PluginFailure) -> None:
        self._failures.append(failure)
        what = (
            f"{failure.error}."
            if failure.collision
            else (
                f"failed to load and its environments are unavailable: {failure.error}. Fix or "
                "uninstall the package that provides it."
            )
        )
        warnings.warn(
            f"envhub: plugin {failure.name!r} ({failure.target}) {what}",
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
        if found is None and isinstance(id, str) and "/" not in id:
            matches = [s for s in self._specs.values() if s.id.split("/", 1)[1] == id]
            if len(matches) > 1:
                raise UnknownEnvError(
                    f"{id!r} is ambiguous: it is {' or '.join(sorted(s.id for s in matches))}; "
                    "give the full id"
                )
            found = matches[0] if matches else None
        if found is None:
            raise UnknownEnvError(self._unknown_message(id))
        self._warn_about(found)
        return found

    def _warn_about(self, found: EnvSpec) -> None:
        """Warn (once per namespace) that a plugin failed or collided in ``found``'s namespace:
        the env the user gets may not be the one they meant."""
        namespace = found.namespace
        related = [f for f in self._failures if f.concerns(namespace)]
        if not related or namespace in self._warned:
            return
        self._warned.add(namespace)
        problems = "; ".join(f"plugin {f.name!r}: {f.error}" for f in related)
        warnings.warn(
            f"envhub: {found.id} is in namespace {namespace!r}, where a plugin failed or "
            f"collided ({problems}); make sure {found.id} is the env you mean (envhub list -n "
            f"{namespace})",
            RuntimeWarning,
            stacklevel=3,
        )

    def _unknown_message(self, id: str) -> str:
        if id in self._contested:
            return self._contested_message(id) + "."
        known = sorted(self._specs)
        message = f"no environment registered under {id!r}."
        namespace = id.split("/", 1)[0] if isinstance(id, str) and "/" in id else None
        note = self._namespace_notes.get(namespace or "")
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
        related = [f for f in self._failures if namespace and f.concerns(namespace)]
        for failure in related:
            what = "has a collision" if failure.collision else "failed to load"
            message += f" The plugin {failure.name!r} ({failure.target}) {what}: {failure.error}."
        if namespace and not related and not any(k.startswith(f"{namespace}/") for k in known):
            message += f" {PYTHON_IDS_HINT}"
        message += " Run `envhub list` to see every id"
        others = len(self._failures) - len(related)
        if others:
            message += f" ({others} plugin(s) failed to load; see `envhub list`)"
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
    """Plugins that failed to load, and ids refused for a collision, with the reason for each."""
    return registry.plugin_errors()
