"""One decorator registry type, so plug-ins (teachers, rewards, data recipes, environments, stage
kinds) reach the engine by name without the engine importing them.

Duplicate names are errors: two plug-ins silently shadowing each other is the bug a registry exists
to prevent. Plug-in packages are found through the ``posttrain.plugins`` entry-point group and by
importing the modules a stage file lists under ``plugins``.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import pathlib
import sys
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import Generic, TypeVar

T = TypeVar("T")

ENTRY_POINT_GROUP = "posttrain.plugins"


class RegistryError(KeyError):
    """A name was registered twice or looked up but never registered."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Name -> object, filled by the ``register`` decorator."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._entries and self._entries[name] is not obj:
                raise RegistryError(
                    f"{self.kind} {name!r} is registered twice "
                    f"(first by {_origin(self._entries[name])}, again by {_origin(obj)}); rename one"
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


def load_plugins(extra_modules: tuple[str, ...] = ()) -> None:
    """Import every plug-in module once: the ``posttrain.plugins`` entry points (this repository's
    own packages, posttrain.trainers among them, are listed there by pyproject.toml, so the engine
    never names them), then ``extra_modules`` (module names or ``path/to/file.py`` listed in a stage
    file). Every registry lookup calls this first, so a stage process has its plug-ins before a
    trainer looks one up."""
    global _loaded
    if not _loaded:
        modules = sorted({ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)})
        if not modules:
            raise RegistryError(
                f"no {ENTRY_POINT_GROUP!r} entry points in {sys.executable}: posttrain is not installed "
                "there; run `pip install -e .` in the repository so its stage kinds and plug-ins register"
            )
        # Set before importing: a plug-in that looks something up while it imports must not start
        # a second round of imports.
        _loaded = True
        try:
            for module in modules:
                importlib.import_module(module)
        except BaseException:
            _loaded = False  # the next lookup raises the same import error, not "unknown name"
            raise
    for module in extra_modules:
        import_plugin(module)


def import_plugin(spec: str) -> None:
    """Import a module by dotted name or by file path (a user's own plug-in file)."""
    if spec.endswith(".py"):
        path = pathlib.Path(spec).resolve()
        if not path.exists():
            raise FileNotFoundError(f"plug-in file {spec} does not exist")
        name = f"posttrain_user_plugin_{path.stem}"
        if name in sys.modules:
            return
        module_spec = importlib.util.spec_from_file_location(name, path)
        assert module_spec and module_spec.loader
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
    else:
        importlib.import_module(spec)
