"""One decorator registry type, for what a stage file names and a user may add to: stage kinds,
engines, environments, tools, task families, teacher domains and data recipes.

Duplicate names are errors: two plug-ins silently shadowing each other is the bug a registry exists
to prevent. A plug-in whose import fails registers nothing: what it registered before the failure is
taken back, so the fixed plug-in imports cleanly in the same process. This repository's own entries
are registered by plain imports (the modules that define them, and `load_plugins`'s imports of the
stage kinds and the shipped data); a third party's package registers through the
``posttrain.plugins`` entry-point group, and a user's module or file through a stage file's
``plugins`` list.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib
import importlib.util
import pathlib
import sys
import threading
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import Any, ClassVar, Generic, TypeVar

T = TypeVar("T")

ENTRY_POINT_GROUP = "posttrain.plugins"


class RegistryError(KeyError):
    """A name was registered twice or looked up but never registered."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Name -> object, filled by the ``register`` decorator.

    named: the entries carry their own name in a ``name`` attribute (tools, task families), which
    must equal the name they are registered under: a tool is offered to the model and called by its
    own name, a prompt names its family by the family's, and lookups go through the registry's.
    """

    # Every registry, so a plug-in whose import fails takes back what it registered (`_all_or_none`).
    _instances: ClassVar[list[Registry[Any]]] = []

    def __init__(self, kind: str, *, named: bool = False) -> None:
        self.kind = kind
        self.named = named
        self._entries: dict[str, T] = {}
        Registry._instances.append(self)

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._entries and self._entries[name] is not obj:
                raise RegistryError(
                    f"{self.kind} {name!r} is registered twice "
                    f"(first by {_origin(self._entries[name])}, again by {_origin(obj)}); rename one"
                )
            own = getattr(obj, "name", None) if self.named else name
            if own != name:
                fix = f"register it as {own!r} or set name = {name!r}" if own else f"set name = {name!r}"
                raise RegistryError(
                    f"{self.kind} {name!r} is registered under another name than its own: "
                    f"{_origin(obj)}.name is {own!r}; {fix}"
                )
            self._entries[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        load_plugins()
        if name not in self._entries:
            close = difflib.get_close_matches(name, list(self._entries), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            known = ", ".join(sorted(self._entries)) or "none"
            raise RegistryError(f"unknown {self.kind} {name!r}{hint} (registered: {known})")
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        load_plugins()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        load_plugins()
        return iter(sorted(self._entries))

    def items(self) -> list[tuple[str, T]]:
        load_plugins()
        return sorted(self._entries.items())


def _origin(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


_loaded = False
# Held while the plug-ins import: a second thread's lookup waits for them instead of finding the
# registries half filled (re-entrant, for a plug-in that looks something up while it imports).
_loading = threading.RLock()


def load_plugins(extra_modules: tuple[str, ...] = ()) -> None:
    """Import every plug-in once: this repository's stage kinds (posttrain.trainers) and shipped
    data (data_recipes: recipes, task families, the calculator tool), then the modules of other
    distributions' ``posttrain.plugins`` entry points, then ``extra_modules`` (module names or
    ``path/to/file.py`` listed in a stage file). Every registry lookup calls this first, so a stage
    process has its plug-ins before a trainer looks one up."""
    global _loaded
    with _loading:
        if not _loaded:
            # Set before importing: a plug-in that looks something up while it imports must not
            # start a second round of imports.
            _loaded = True
            try:
                # Imported here, not at the top: both import this module's registries.
                import data_recipes  # noqa: F401
                import posttrain.trainers  # noqa: F401

                for module in third_party_plugins():
                    with _all_or_none():
                        importlib.import_module(module)
            except BaseException:
                _loaded = False  # the next lookup raises the same import error, not "unknown name"
                raise
    for module in extra_modules:
        import_plugin(module)


def third_party_plugins() -> list[str]:
    """The modules named by other distributions' ``posttrain.plugins`` entry points. posttrain's
    own are skipped: its packages are imported by name above, and an install made before they
    stopped being entry points still lists them in its metadata."""
    return sorted(
        {
            ep.value
            for ep in entry_points(group=ENTRY_POINT_GROUP)
            if ep.dist is None or ep.dist.name != "posttrain"
        }
    )


@contextlib.contextmanager
def _all_or_none() -> Iterator[None]:
    """A plug-in's registrations, kept only if its import finishes: the entries of one that failed
    half-way are taken back with it, or the fixed plug-in's retry (in a notebook, a test, a
    long-lived process) met its own first half as "registered twice"."""
    before = [(registry, dict(registry._entries)) for registry in Registry._instances]
    try:
        yield
    except BaseException:
        for registry, entries in before:
            registry._entries.clear()
            registry._entries.update(entries)
        raise


def import_plugin(spec: str) -> None:
    """Import a module by dotted name or by file path (a user's own plug-in file): all of its
    registrations, or none where the import fails."""
    with _all_or_none():
        _import(spec)


def _import(spec: str) -> None:
    if spec.endswith(".py"):
        path = pathlib.Path(spec).resolve()
        if not path.exists():
            raise FileNotFoundError(f"plug-in file {spec} does not exist")
        # Named by the resolved path, not the file name alone: a/domain.py and b/domain.py are two
        # plug-ins, while one file listed by two stage files (or twice) is imported once.
        digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
        name = f"posttrain_user_plugin_{path.stem}_{digest}"
        if name in sys.modules:
            return
        module_spec = importlib.util.spec_from_file_location(name, path)
        assert module_spec and module_spec.loader
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            # A half-imported module left here would make the next import a silent no-op: the
            # fixed file could not be retried, and its real error would turn into "unknown name".
            del sys.modules[name]
            raise
    else:
        importlib.import_module(spec)
