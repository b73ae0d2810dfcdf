"""Loading models: embedded aliases (``embedded.py``), GGUF files (``gguf.py``), local
folders and HF ids; the dtype and device they compute in.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvboost_rag.core.config import KVBoostConfig
from kvboost_rag.core.errors import UnknownModelError
from kvboost_rag.core.model import torch_compat
from kvboost_rag.core.model.converted import NotConverted, load_converted
from kvboost_rag.core.model.embedded import EMBEDDED_MODELS, converted_checkpoint, gguf_path
from kvboost_rag.core.model.gguf import converted_folder, is_gguf


def default_cache_root() -> Path:
    """Where converted models live: ``$XDG_CACHE_HOME/kvboost-rag`` (``~/.cache`` default)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvboost-rag"


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the hardware computes it natively, else fp32 (never fp16 on CPU)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and torch_compat.mkldnn_bf16_supported():
        return torch.bfloat16
    return torch.float32


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# The dtypes a model can compute in. Integer and 8-bit types are storage formats: weights
# quantize through ``weights=`` (or a quantized checkpoint's ``quantization_config``),
# stored KV through ``KVBoostConfig.kv_codec``.
COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# Short names people write, and the name the choice goes by.
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def check_dtype(dtype: object) -> torch.dtype | None:
    """``dtype`` (None, a torch dtype or its name, e.g. "bfloat16") as a torch dtype the
    model can compute in; ``ValueError`` naming the choices, ``TypeError`` for another type."""
    if dtype is None:
        return None
    if not isinstance(dtype, (str, torch.dtype)):
        raise TypeError(f"dtype must be a str or a torch.dtype, got {type(dtype).__name__}")
    name = str(dtype).removeprefix("torch.")
    if name in COMPUTE_DTYPES:
        return COMPUTE_DTYPES[name]
    hint = f" (did you mean {_DTYPE_ALIASES[name]!r}?)" if name in _DTYPE_ALIASES else ""
    if name.startswith(("int", "uint", "float8", "fp8")):
        hint = (
            f"; {name} is a storage format, not a compute dtype: quantize the weights with "
            f"weights={_weights_hint(name)!r} (on a CPU), load a quantized checkpoint "
            "(quantization_config=), or store KV compactly with KVBoostConfig(kv_codec=...)"
        )
    raise ValueError(
        f"dtype must be one of {sorted(COMPUTE_DTYPES)} or None (auto), got {dtype!r}{hint}"
    )


def _weights_hint(dtype: str) -> str:
    """The ``weights=`` kind nearest a storage dtype someone passed as ``dtype``."""
    return "int4" if dtype in ("int4", "uint4") else "int8"


def check_device(device: object) -> torch.device:
    """``device`` (None: CUDA when available, else CPU) as a torch device this machine has;
    ``ValueError`` for a name torch does not know or a device that is not there."""
    if device is None:
        return default_device()
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or a torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"device {device!r} is not a torch device: pass 'cpu', 'cuda', 'cuda:1', 'mps' or "
            "None (auto)"
        ) from None
    missing = _missing_device(dev)
    if missing:
        raise ValueError(
            f"device {device!r} is not available: {missing}; pass device='cpu' or None (auto)"
        )
    return dev


def _missing_device(dev: torch.device) -> str | None:
    """Why ``dev`` cannot hold a model here; None when it can."""
    if dev.type == "cpu":
        return None
    backend = getattr(torch, dev.type, None) if dev.type in ("cuda", "xpu", "mps") else None
    if backend is None:
        return f"models are loaded on cpu, cuda, xpu or mps, not {dev.type}"
    if not backend.is_available():
        return f"this torch build ({torch.__version__}) sees no {dev.type} device"
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if dev.index is not None and dev.index >= count:
        return f"there are {count} {dev.type} device(s), numbered from 0"
    return None


# A Hugging Face model id: "org/name" (letters, digits, "-", "_", "." in each part).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def resolve_model_path(
    name: str, cache_root: Path | None = None, gguf_file: str | None = None
) -> str:
    """The model folder to load for ``name``: an embedded alias's converted checkpoint, a
    GGUF file's converted folder (``name`` the file, or a folder or HF id holding
    ``gguf_file``), or a local model folder or HF id as given. Raises
    ``UnknownModelError`` for anything else (a path with no model, a folder without
    ``config.json``, a malformed id), before transformers reads it."""
    if not isinstance(name, str):
        raise TypeError(
            f"model must be a str (an alias, a folder, a GGUF file or an HF id), got "
            f"{type(name).__name__}"
        )
    if not name.strip():
        raise UnknownModelError(
            f"model is empty: pass an embedded alias {sorted(EMBEDDED_MODELS)}, a model "
            "folder, a GGUF file or an HF id"
        )
    root = cache_root or default_cache_root()
    if gguf_file is not None:
        return str(converted_folder(_gguf_in(name, gguf_file), root))
    if name.lower() in EMBEDDED_MODELS:
        return str(converted_checkpoint(name.lower(), root))
    path = Path(name).expanduser()
    if path.is_file():
        if not is_gguf(path):
            raise UnknownModelError(
                f"{name!r} is a file but not a GGUF file: pass a GGUF file, a model folder "
                "(written by save_pretrained), an embedded alias or an HF id"
            )
        return str(converted_folder(path, root))
    if path.exists():
        return str(_model_folder(path, name))  # "~" expanded: transformers reads a hub id
    if _HUB_ID.fullmatch(name) and not name.endswith("."):
        _check_reachable(name)
        return name
    raise UnknownModelError(
        f"unknown model {name!r}: no such file or folder, and not an embedded alias "
        f"{sorted(EMBEDDED_MODELS)} nor a Hugging Face id like 'org/name'"
    )


def gguf_source(
    name: str, cache_root: Path | None = None, gguf_file: str | None = None
) -> Callable[[], Path] | None:
    """For a model ``resolve_model_path`` took from a GGUF (an embedded alias, a GGUF file,
    ``gguf_file=``), what gives that file (an alias's is assembled only when asked); None for
    any other model."""
    root = cache_root or default_cache_root()
    if gguf_file is not None:
        return lambda: _gguf_in(name, gguf_file)
    if name.lower() in EMBEDDED_MODELS:
        return lambda: gguf_path(name.lower(), root)
    path = Path(name).expanduser()
    return (lambda: path) if path.is_file() and is_gguf(path) else None


def _model_folder(folder: Path, name: str) -> Path:
    if (folder / "config.json").is_file():
        return folder
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))
    hint = (
        f"; it holds GGUF files {ggufs}: pass one as the model, or gguf_file="
        if ggufs
        else " (a folder written by model.save_pretrained() and tokenizer.save_pretrained())"
    )
    raise UnknownModelError(f"{name!r} is not a model folder: it has no config.json{hint}")


def _gguf_in(name: str, gguf_file: str) -> Path:
    """The local GGUF file ``gguf_file`` of a folder or HF id ``name`` (as transformers'
    ``gguf_file=`` names it); from the hub only when it may be asked."""
    if not isinstance(gguf_file, str) or not gguf_file:
        raise TypeError(f"gguf_file must be a file name, got {gguf_file!r}")
    folder = Path(name).expanduser()
    if folder.is_dir():
        path = folder / gguf_file
        if not path.is_file():
            raise UnknownModelError(f"{gguf_file!r} is not a file in {name!r}")
        return path
    if not _HUB_ID.fullmatch(name):
        raise UnknownModelError(f"gguf_file= needs a folder or an HF id, got {name!r}")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(name, gguf_file))
    except LocalEntryNotFoundError:
        raise UnknownModelError(
            f"{gguf_file!r} of {name!r} is not in the local Hugging Face cache and the hub "
            "cannot be reached: pass the local GGUF file"
        ) from None


def _check_reachable(model_id: str) -> None:
    """An HF id transformers can load: in the local hub cache, or the hub may be asked."""
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE and not isinstance(
        try_to_load_from_cache(model_id, "config.json"), str
    ):
        raise UnknownModelError(
            f"model {model_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is "
            "set: pass a local model folder or an embedded alias, or download it first"
        )


def load_model(
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    *,
    skip: Callable[[Any], Collection[str]] | None = None,
    **model_kwargs: Any,
) -> tuple[Any, Any]:
    """The model and tokenizer of the folder or HF id ``path`` in ``dtype`` on ``device``.
    ``skip``: for a folder ``convert_gguf`` wrote, a function of the built model naming the
    tensors the caller replaces, left unread (``converted.load_converted``, on a CPU with
    no other loading option; not called when the folder is not one); None: any folder,
    loaded by transformers' ``from_pretrained``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if skip is not None and not model_kwargs and device.type == "cpu":
        try:
            return load_converted(Path(path), dtype, skip), tokenizer
        except NotConverted:
            pass  # a folder of another make: transformers reads it
    with _no_loading_bar():
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **model_kwargs)
        except TypeError as error:  # an argument neither from_pretrained nor the model takes
            if "unexpected keyword argument" not in str(error):
                raise
            raise TypeError(
                f"model_kwargs {sorted(model_kwargs)} go to transformers' from_pretrained, and "
                f"one is not a loading option of this model ({error})"
            ) from None
    if "device_map" not in model_kwargs:
        model.to(device)  # type: ignore[arg-type]
    return model.eval(), tokenizer


@contextmanager
def _no_loading_bar() -> Iterator[None]:
    """Without transformers' "Loading weights" bar, printed on every load (its switch is
    process-wide, so it is put back as it was)."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def check_attn_implementation(value: object) -> None:
    """``attn_implementation=`` checked before anything loads (transformers refuses an
    unknown one only after the tokenizer and config loaded, from its own module): a name it
    has, with its ``paged|`` prefix or not, or a hub kernel. Raises ``TypeError`` /
    ``ValueError`` listing the names."""
    from kvboost_rag.core.model.hf_compat import attention_implementations, is_hub_kernel

    if value is None:
        return
    if not isinstance(value, str):
        raise TypeError(f"attn_implementation must be a str, got {type(value).__name__}")
    names = attention_implementations()
    if value.removeprefix("paged|") in names or is_hub_kernel(value):
        return
    raise ValueError(
        f"attn_implementation {value!r} is not an attention transformers has: pass one of "
        f"{tuple(names)} (the flash ones need flash-attn and a GPU), a hub kernel "
        "'org/repo', or leave it out (sdpa)"
    )


def check_model_kwargs(model_kwargs: dict[str, Any]) -> None:
    """``KVBoost.from_pretrained``'s extra arguments are transformers': an engine setting among
    them would reach the model's constructor and fail there, after loading."""
    settings = sorted(set(model_kwargs) & {f.name for f in dataclasses.fields(KVBoostConfig)})
    if settings:
        given = ", ".join(f"{name}={model_kwargs[name]!r}" for name in settings)
        raise TypeError(
            f"{', '.join(settings)}: engine settings, not model-loading arguments; pass "
            f"config=KVBoostConfig({given})"
        )
    if "torch_dtype" in model_kwargs:
        raise TypeError("pass dtype= (torch_dtype is transformers' old name for it)")
    check_attn_implementation(model_kwargs.get("attn_implementation"))
