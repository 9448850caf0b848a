"""Child processes that start without importing torch again.

A fresh interpreter spends ~4 CPU-seconds importing torch (and torch._dynamo, which the first optimizer
pulls in) before it does any work: a local pipeline of four stage processes paid 16 of them, and the test
suite hundreds. multiprocessing's fork server is a process started fresh, before any thread, that imports
what it is told once and forks each child from itself: the child is as clean as a spawned one (its own
pipes, no threads of the parent's), and pays only for its own work. Everything that wants such children
asks here, so that there is one fork server per process and it preloads what every caller named before it
started. Where there is none (Windows), children are spawned.
"""
from __future__ import annotations

import multiprocessing
from collections.abc import Iterable
from multiprocessing.context import ForkServerContext, SpawnContext

_PRELOAD = {"torch", "torch._dynamo"}  # (none of them opens a socket or starts a thread when imported)


def preloaded_context(preload: Iterable[str] = ()) -> ForkServerContext | SpawnContext:
    """The fork server's context, which imports `preload` too if it has not started yet. A child
    inherits the fork server's environment and working directory, not the caller's: pass what it needs."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    _PRELOAD.update(preload)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(sorted(_PRELOAD))  # (takes effect when it starts: the first child)
    return context
