"""Plug-ins: what installed packages add by name through an entry-point group (model architectures,
averaging strategies), loaded only when first looked up. Only names cross the network, never code."""
from __future__ import annotations

import importlib.metadata
from typing import Callable


def entry_points(group: str) -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=group)}


def load_plugin(group: str, name: str, what: str, error: type[Exception]) -> Callable | None:
    """The callable that plug-in `name` of `group` provides, None when no package provides it; `error`
    (naming `what`) when it fails to load or is not callable: a broken plug-in must not look unknown."""
    entry_point = entry_points(group).get(name)
    if entry_point is None:
        return None
    try:
        loaded = entry_point.load()
    except Exception as exc:
        raise error(f"{what} plugin {name!r} ({entry_point.value}) failed to load: {exc}") from exc
    if not callable(loaded):
        raise error(f"{what} plugin {name!r} ({entry_point.value}) is not callable")
    return loaded
