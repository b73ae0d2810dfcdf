"""Freeing a thread's OpenMP worker pool once it no longer runs the engine's forwards.

torch's CPU build runs its parallel work (and MKL's and oneDNN's) on GNU OpenMP, which
gives every thread that starts parallel work a pool of workers of its own, kept until that
thread exits. While the pools' threads outnumber the cores, libgomp's workers stop spinning
between parallel regions and sleep, so each of a decoding step's hundreds of matrix
products pays a wake-up. A process where the model was loaded on one thread and the serving
loop runs on another is in that state for as long as both live. Measured on a 2-core AMD
EPYC (SmolLM2-135M, fp32, one decoder layer's products at 8 rows): 124.9 us a product on a
second thread, 46.8 us there once the loading thread's pool was freed, 65.5 us on the
loading thread.

``release_pool`` frees the calling thread's pool with OpenMP 5's
``omp_pause_resource_all`` (libgomp frees the caller's pool; its next parallel region
starts a new one, a thread start later). The engine calls it on a thread that constructed
it, that waits for the loop, or that stops running the loop, so the loop's thread is the
one that keeps a pool. It does nothing where torch does not run on libgomp.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import torch

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: soft pause (libgomp frees the caller's pool)


@functools.cache
def _libgomp() -> Any:
    """The ``omp_pause_resource_all`` of the libgomp torch's own library binds to, or None
    (other wheels bring copies of libgomp: scikit-learn's, sentencepiece's)."""
    if not torch.backends.openmp.is_available():
        return None
    try:
        with open("/proc/self/maps") as maps:
            torch_libraries = {line.split()[-1] for line in maps if "/libtorch_cpu" in line}
    except OSError:  # not Linux
        return None
    for path in sorted(torch_libraries):
        try:  # looked up through libtorch_cpu's handle: its dependencies, in its order
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # a runtime without OpenMP 5's pause
            continue
        if "libgomp" not in os.path.basename(_defined_in(pause)):
            return None  # another OpenMP runtime (Intel's, LLVM's): no throttling to undo
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return pause
    return None


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _defined_in(function: Any) -> str:
    """The file of the shared library that defines ``function`` ("" where unknown)."""
    info = _DlInfo()
    try:
        dladdr = ctypes.CDLL(None).dladdr
    except AttributeError:
        return ""
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    if not dladdr(ctypes.cast(function, ctypes.c_void_p), ctypes.byref(info)):
        return ""
    return (info.dli_fname or b"").decode(errors="replace")


def release_pool() -> bool:
    """Free the calling thread's OpenMP worker pool; whether libgomp was there to ask."""
    pause = _libgomp()
    if pause is None:
        return False
    return int(pause(OMP_PAUSE_SOFT)) == 0
