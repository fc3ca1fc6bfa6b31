"""`bcd node`'s use of the C allocator (glibc malloc), for its idle memory (docs/benchmarks.md, idle_rss_mb).

- `limit_arenas`: one malloc arena for the whole process, set before trio's first worker thread. glibc
  gives each thread that allocates its own arena (64 MiB reserved, a megabyte or more touched and kept);
  the node's worker threads (journal writes, observations, status.json) run Python that holds the GIL,
  so they gain nothing from arenas of their own. Measured: 1.3-1.5 MB of the idle node's RSS.
- `release_free_heap`: `malloc_trim(0)`, once start-up is over. Importing ~640 modules frees as much as
  it keeps (each .pyc's bytes, the import machinery's transients) in between what stays; glibc gives
  back only the top of the heap, so ~2.3 MB of free pages stayed resident for the node's life.

Both are no-ops where the C library has no such call (musl); nothing else depends on them. The helper
pins its malloc the same way for another reason (bcd_helper.serve._bound_malloc, docs/helper.md).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

log = logging.getLogger("bcd.node")

M_ARENA_MAX = -8  # glibc's malloc.h


def _libc() -> Any:
    try:
        return ctypes.CDLL(None)
    except OSError:  # no C library to ask: nothing to tune
        return None


def limit_arenas(arenas: int = 1, libc: Any = None) -> bool:
    """Cap glibc's malloc arenas (mallopt M_ARENA_MAX); call before any thread starts. False where the
    C library has no mallopt or refused."""
    mallopt = getattr(libc or _libc(), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(M_ARENA_MAX, arenas))


def release_free_heap(libc: Any = None) -> bool:
    """Return the heap's free pages to the system (malloc_trim(0)): a fraction of a millisecond for the
    node's heap. False where the C library has no malloc_trim or nothing was released."""
    trim = getattr(libc or _libc(), "malloc_trim", None)
    if trim is None:
        return False
    return bool(trim(0))
