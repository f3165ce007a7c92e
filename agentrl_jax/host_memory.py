"""Host heap policy for real-size runs (glibc; a no-op elsewhere).

glibc serves allocations under its mmap threshold from the heap, and raises
that threshold up to 32 MiB as large blocks are freed, so the host copies a
run makes and drops (a model's weights while the train state is built, an
orbax save, the compiler's working memory) stay mapped as free heap, and
the next large allocation, the step's temporaries, cannot reuse them
(what that costs a real-size run: benchmarks/smoke_run.py and its figures
in benchmarks/README.md).
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _libc():
  try:
    libc = ctypes.CDLL("libc.so.6")
    return libc if hasattr(libc, "malloc_trim") else None
  except OSError:
    return None


def release_freed() -> None:
  """Returns the heap's free pages to the OS (malloc_trim)."""
  if _libc() is not None:
    _libc().malloc_trim(0)
