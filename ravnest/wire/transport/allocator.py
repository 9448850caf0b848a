"""How this process's C allocator keeps the megabyte buffers every message allocates."""
from __future__ import annotations

import ctypes
import ctypes.util


def keep_freed_buffers() -> None:
    """Let glibc malloc reuse freed tensor-sized blocks instead of handing them back to the kernel.

    Every message allocates buffers of megabytes (frames, tensors). By default glibc maps most of
    them fresh and unmaps or trims them on free, so each byte received or sent pays a page fault
    (a third of the sender's CPU in bench.wire). Blocks below 32 MiB (glibc's ceiling for the
    threshold) now come from the heap, and up to 256 MiB of free heap is kept. At most two heaps
    (arenas): with one per thread, a flood of 4 MiB probes left 95 MiB that malloc_trim could not
    return (fragmented over the server's threads' arenas); with two, 10 MiB. Process-wide and
    idempotent; called by PeerServer and OutboundStream; a no-op without glibc.
    """
    global _malloc_tuned
    if _malloc_tuned:
        return
    _malloc_tuned = True
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    for option, value in _MALLOPT.items():
        mallopt(option, value)


_malloc_tuned = False
# M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_TOP_PAD, M_ARENA_MAX
_MALLOPT = {-3: 32 << 20, -1: 256 << 20, -2: 16 << 20, -8: 2}
