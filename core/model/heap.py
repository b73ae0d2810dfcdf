"""Freed memory given back to the system while a model loads."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from collections.abc import Callable


def release_freed_memory(collect: bool = True) -> None:
    """Give what was freed (float weights replaced, fp32 copies cast, a tensor's
    temporaries) back to the system: glibc keeps freed heap mapped, and short-lived arrays
    between long-lived ones keep it from shrinking, so a 0.5B on its blocks stayed ~0.7 GB
    larger than what it holds, and the 1.5B's first start on its blocks held 0.6 GB of
    freed temporaries among the packed tensors. ``collect``: run the garbage collector
    first. A no-op off glibc."""
    if collect:
        gc.collect()
    trim = _trim()
    if trim is not None:
        trim(0)


@functools.cache
def _trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return getattr(libc, "malloc_trim", None)
