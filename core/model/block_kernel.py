"""The CPU kernels of our own (``kernels/*.c``): built once per machine with the system's C
compiler into the cache root, loaded with ctypes. ``block_gemm.c`` multiplies activations by
weights kept in a GGUF's blocks; ``few_query_attention.c`` is a decoding step's attention
over a cache read in its own dtype (``attention.py`` says why); ``layer_ops.c`` a decoder
layer's norms, RoPE and SiLU in one call each (``lean_layers.py``).

No maintained CPU kernel multiplies many rows by 4-bit weights without dequantizing them
(measured on this torch: ``_weight_int4pack_mm_for_cpu`` reads its weights once per input
row, 2.8x a bf16 product at 512 rows; ``_dyn_quant_matmul_4bit`` is a reference loop off
Arm; torchao's CPU layouts dequantize; IPEX has no build for this torch), so this module
holds the one kernel of our own, tested against the dequantized product
(``tests/model/test_blocks.py``). It needs AVX512 with VNNI (Xeon since Cascade Lake, AMD
since Zen 4) and a C compiler; ``available()`` says why not where it cannot run, and a
GGUF's default then is its dequantized float weights (``quantized.weights_for``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("kernels") / "block_gemm.c"
ATTENTION = SOURCE.with_name("few_query_attention.c")
LAYER_OPS = SOURCE.with_name("layer_ops.c")
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma")
# a source's own flags: layer_ops rounds where transformers' operators round, so no product
# and sum may fuse into one rounding
OWN_FLAGS = {"layer_ops.c": ("-ffp-contract=off",)}
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma")

_int, _i64, _ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p


def missing() -> str | None:
    """Why the kernel cannot run here (None: it can)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"it runs on x86-64 Linux, not {platform.system()} {platform.machine()}"
    flags = _cpu_flags()
    lacking = [f for f in CPU_FLAGS if f not in flags]
    if lacking:
        return f"this CPU lacks {', '.join(lacking)}"
    if _compiler() is None:
        return "no C compiler (cc / gcc) on PATH to build it"
    return None


def available() -> bool:
    return missing() is None


def version(source: Path = SOURCE) -> str:
    """What names a kernel's numerics and layouts: its source and flags (the block kernel's
    is a key part of the packed weights cached on disk)."""
    flags = " ".join(_flags(source)).encode()
    digest = hashlib.blake2b(source.read_bytes() + flags, digest_size=6)
    return digest.hexdigest()


@cache
def library(cache_root: Path, source: Path = SOURCE) -> ctypes.CDLL:
    """The built kernel of ``source`` (built into ``cache_root/kernels`` the first time)."""
    reason = missing()
    if reason:
        raise RuntimeError(f"the {source.stem} kernel cannot run: {reason}")
    built = cache_root / "kernels" / f"{source.stem}-{version(source)}.so"
    if not built.exists():
        _build(built, source)
    lib = ctypes.CDLL(str(built))
    if source == SOURCE:
        lib.block_linear.argtypes = [_ptr, _int, _i64, _i64, _int, _ptr, _ptr, _ptr, _int,
                                     _int, _ptr, _ptr, _i64, _int]  # fmt: skip
        lib.block_linear.restype = _int
        lib.block_linear_k4.argtypes = [_ptr, _int, _i64, _i64, *[_ptr] * 6, _i64, _int]
        lib.block_linear_k4.restype = _int
        lib.block_linear_k6.argtypes = lib.block_linear_k4.argtypes
        lib.block_linear_k6.restype = _int
    elif source == LAYER_OPS:
        lib.rms_norm.argtypes = [*[_ptr] * 5, _int, _i64, _i64, ctypes.c_float, _int]
        lib.rope.argtypes = [_ptr, _i64, _ptr, _ptr, _int, _ptr, _int, *[_i64] * 4, _int]
        lib.silu_mul.argtypes = [_ptr, _ptr, _i64, _ptr, _int, _i64, _i64, _int]
        for name in ("rms_norm", "rope", "silu_mul"):
            getattr(lib, name).restype = None
    else:
        lib.few_query_attention.argtypes = [_ptr, _int, _ptr, _ptr, _int, _ptr, *[_i64] * 15,
                                            ctypes.c_float, _ptr, _int]  # fmt: skip
        lib.few_query_attention.restype = _int
    return lib


def optional(cache_root: Path, source: Path) -> ctypes.CDLL | None:
    """``library`` where the kernel can run here, None where it cannot (built on first use)."""
    return None if missing() is not None else library(cache_root, source)


class Kernels:
    """The kernel's entry points, looked up once; a model's deep copy shares them (ctypes
    functions cannot be copied)."""

    def __init__(self, library: Any) -> None:
        self.legacy, self.k4, self.k6 = (
            library.block_linear,
            library.block_linear_k4,
            library.block_linear_k6,
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Kernels:
        return self


class Addresses:
    """Where a layer's packed tensors are (None: empty), read again when its ``q`` is another
    tensor (its siblings joined, the module moved): a buffer read through ``nn.Module``
    costs ~0.7 us, and a call read five. A model's deep copy starts afresh (its tensors may
    be copies)."""

    def __init__(self) -> None:
        self.of_q: torch.Tensor | None = None
        self.q: int | None = None
        self.scale: int | None = None
        self.mins: int | None = None
        self.units: int | None = None
        self.high: int | None = None
        self.bias: int | None = None

    def of(self, buffers: dict[str, Any], bias: torch.Tensor | None) -> Addresses:
        if buffers["q"] is not self.of_q or (bias is None) != (self.bias is None):
            for name in ("q", "scale", "mins", "units", "high"):
                t = buffers[name]
                setattr(self, name, t.data_ptr() if t.numel() else None)
            self.bias = None if bias is None else bias.data_ptr()
            self.of_q = buffers["q"]
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Addresses:
        return Addresses()


def _build(target: Path, source: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    flags = [*_flags(source), "-fopenmp", "-shared", "-fPIC"]
    command = [str(_compiler()), *flags, str(source), "-o", tmp]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building the {source.stem} kernel failed: {done.stderr[-1500:]}")
    os.replace(tmp, target)  # atomic: a concurrent build leaves one whole file


def _flags(source: Path) -> tuple[str, ...]:
    return (*FLAGS, *OWN_FLAGS.get(source.name, ()))


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


@cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((row for row in text.splitlines() if row.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())
