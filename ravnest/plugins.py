"""Plug-ins: what installed packages add by name through an entry-point group (model architectures,
averaging strategies), loaded only when first looked up. Only names cross the network, never code.

`PluginRegistry` is the one lookup both registries use: names registered in-process (the built-ins,
whose modules are found by listing their package, with no hand-kept list), then entry points.
"""
from __future__ import annotations

import importlib
import logging
import importlib.metadata
import pkgutil
import threading
from typing import Any, Callable, Generic, TypeVar

from ravnest.errors import did_you_mean

T = TypeVar("T")
log = logging.getLogger(__name__)


def entry_points(group: str) -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=group)}


def load_plugin(group: str, name: str, what: str, error: type[Exception]) -> object | None:
    """What plug-in `name` of `group` provides, None when no package provides it; `error` (naming
    `what`) when it fails to load: a broken plug-in must not look unknown."""
    entry_point = entry_points(group).get(name)
    if entry_point is None:
        return None
    try:
        return entry_point.load()
    except Exception as exc:
        raise error(f"{what} plugin {name!r} ({entry_point.value}) failed to load: {exc}") from exc


def _callable(name: str, loaded: object) -> Any:
    return loaded if callable(loaded) else None


class PluginRegistry(Generic[T]):
    """Items of one kind by name. Built-ins register themselves when their modules are imported: every
    module of `package` is, on the first lookup of a name not registered yet. Plug-ins are entry points
    of `group`, loaded when first looked up and passed through `adapt`, which makes the registry's item
    of it or returns None (not one of ours); by default any callable is one. `eager`: every plug-in is
    loaded with the built-ins, so a lookup never loads code (names that arrive from the network), and a
    plug-in that fails to load is left out, with a warning."""

    def __init__(self, group: str, what: str, error: type[Exception], *, package: str | None = None,
                 adapt: Callable[[str, Any], T | None] = _callable, eager: bool = False):
        self.group, self.what, self.error, self.package, self.adapt = group, what, error, package, adapt
        self.eager = eager
        self._items: dict[str, T] = {}
        self._imported = package is None
        # the first lookups may come from several threads at once (a coordinator's request threads
        # after a restart): one imports, the others wait until every built-in has registered
        self._importing = threading.RLock()
        self._loading = False

    def copy(self) -> PluginRegistry[T]:
        """Another registry with what this one holds (tests register into a copy)."""
        other: PluginRegistry[T] = PluginRegistry(self.group, self.what, self.error, package=self.package,
                                                  adapt=self.adapt, eager=self.eager)
        self._import_built_ins()
        other._items, other._imported = dict(self._items), True
        return other

    def register(self, name: str, item: T) -> T:
        self._items[name] = item
        return item

    def _import_built_ins(self) -> None:
        if self._imported:
            return
        with self._importing:
            if self._imported or self._loading:  # another thread finished meanwhile; or a built-in's
                return                            # own import looks something up (this thread)
            self._loading = True
            try:
                if self.package is not None:
                    for module in pkgutil.iter_modules(importlib.import_module(self.package).__path__):
                        importlib.import_module(f"{self.package}.{module.name}")
                if self.eager:
                    self._load_every_plugin()
                self._imported = True  # only now: a lookup before this point would miss names
            finally:
                self._loading = False

    def _load_every_plugin(self) -> None:
        for name in entry_points(self.group):
            if name in self._items:
                continue
            try:
                loaded = load_plugin(self.group, name, self.what, self.error)
            except self.error as broken:
                log.warning("%s", broken)
                continue
            item = self.adapt(name, loaded)
            if item is None:
                log.warning("%s plugin %r does not provide a %s; left out", self.what, name, self.what)
            else:
                self.register(name, item)

    def names(self) -> list[str]:
        """Built-in, registered and installed (entry-point) names."""
        self._import_built_ins()
        return sorted(set(self._items) | (set() if self.eager else set(entry_points(self.group))))

    def items(self) -> list[T]:
        """What is registered so far: every built-in, and the plug-ins looked up."""
        self._import_built_ins()
        return list(self._items.values())

    def known(self, name: str) -> bool:
        self._import_built_ins()
        return name in self._items or (not self.eager and name in entry_points(self.group))

    def get(self, name: str) -> T:
        """The item named `name`; `error` when none is, or its plug-in is broken."""
        self._import_built_ins()
        if name in self._items:
            return self._items[name]
        loaded = None if self.eager else load_plugin(self.group, name, self.what, self.error)
        if loaded is None:
            raise self.error(f"unknown {self.what} {name[:40]!r}{did_you_mean(name, self.names())}; "
                             f"known: {', '.join(self.names())}")
        item = self.adapt(name, loaded)
        if item is None:
            raise self.error(f"{self.what} plugin {name!r} does not provide a {self.what} (it is not callable)")
        return self.register(name, item)
