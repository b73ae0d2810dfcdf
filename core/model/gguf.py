"""GGUF files as model folders: dequantized once, saved as safetensors.

transformers reads a GGUF (``gguf_file=``) by dequantizing every tensor, which takes 10-60 s
and holds the whole model in float32 before it builds it (a 7B's 28 GB, more than many
machines have). ``convert_gguf`` writes an ordinary model folder instead (fp32 safetensors:
the GGUF's values exactly, whatever dtype the model then computes in), tensor by tensor
through transformers' own per-architecture processing (``hf_compat.gguf_tensors``), in
shards of ``SHARD_BYTES``, so memory holds one shard and one tensor at a time (a large
tensor transformers leaves as it is, one slice of it: ``hf_compat.Streamed``); atomically,
once; later loads read that folder in seconds. ``converted_folder`` keeps one such folder
per GGUF file in the cache root.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvboost_rag.core.errors import UnknownModelError
from kvboost_rag.core.model import hf_compat
from kvboost_rag.core.model.gguf_header import formats, read_header
from kvboost_rag.core.model.heap import release_freed_memory

GGUF_MAGIC = b"GGUF"
SHARD_BYTES = 512 * 2**20  # float32 bytes a shard of the converted folder holds at most
FORMATS_FILE = "gguf-formats.json"  # the source file's parameters per format

# Tokens that end a turn in the chat formats of the families GGUF files carry, besides the
# file's own EOS: llama.cpp treats the same texts as end of generation when they are in
# the vocabulary (Qwen's release stops at <|im_end|> and <|endoftext|>; the GGUF names
# only the first).
END_OF_TURN = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|end|>",
    "<|return|>",
)


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file that starts like a GGUF file."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def convert_gguf(
    gguf: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    chat_template: str | None = None,
    stop_tokens: Sequence[str] | None = None,
) -> Path:
    """Write the model and tokenizer in ``gguf`` as a model folder ``out`` (fp32
    safetensors) that ``KVBoost.from_pretrained`` and transformers load directly; returns
    ``out``. ``chat_template``: the template to save where the file carries none.
    ``stop_tokens``: texts of the tokens that end a turn besides EOS (None: those of
    ``END_OF_TURN`` the vocabulary holds). The folder appears whole or not at all; an
    existing model folder ``out`` is left as it is; any other existing ``out`` is refused
    before any work (``FileExistsError``). ``UnknownModelError`` when ``gguf`` is not a GGUF
    file."""
    source, target = Path(gguf).expanduser(), Path(out).expanduser()
    if not is_gguf(source):
        raise UnknownModelError(f"{str(gguf)!r} is not a GGUF file (it does not start with GGUF)")
    if (target / "model.safetensors").exists() or (target / "config.json").exists():
        return target
    check_out(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        _write(source, tmp, chat_template, stop_tokens)
        release_freed_memory()  # the dequantized tensors' heap: a start follows
        tmp.chmod(0o755)  # mkdtemp makes it private; a model folder is shared like any other
        try:
            os.rename(tmp, target)  # atomic; a concurrent converter may have won the race
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def source_formats(folder: Path, source: Callable[[], Path]) -> dict[str, int]:
    """Parameters per format (gguf-py's names: "Q4_K", "F32", ...) of the GGUF file
    ``folder`` was converted from: as the conversion recorded them (``FORMATS_FILE``), or
    for a folder converted before it did, read from the file's header (``source()``) and
    recorded where the folder can be written."""
    record = folder / FORMATS_FILE
    try:
        return dict(json.loads(record.read_text())["formats"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    found = formats(read_header(source()).tensors)
    try:
        _record(folder, found)
    except OSError:
        pass  # a folder the user may not write: read from the file each start (~50 ms)
    return found


def _record(folder: Path, found: dict[str, int]) -> None:
    tmp = folder / f".{FORMATS_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps({"formats": found}, indent=1))
    os.replace(tmp, folder / FORMATS_FILE)


def check_out(target: Path) -> None:
    """``FileExistsError`` when ``target`` exists and is not a model folder (a file, or a
    folder holding other things): the conversion would end by failing to move there."""
    if target.exists() and not (target / "config.json").exists():
        if target.is_file() or any(target.iterdir()):
            what = "a file" if target.is_file() else "a folder that is not a model folder"
            raise FileExistsError(f"--out {target} is {what}: pass a new folder")


def converted_folder(gguf: Path, cache_root: Path) -> Path:
    """The converted folder of ``gguf`` in ``cache_root`` (converted now if it is not
    there), named by the file's name, size and modification time."""
    stat = gguf.stat()
    stamp = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    name = f"{gguf.stem}-{hashlib.blake2b(stamp, digest_size=8).hexdigest()}"
    return convert_gguf(gguf, cache_root / "models" / name)


def stop_ids(tokenizer: Any, stop_tokens: Sequence[str] | None) -> list[int]:
    """EOS, then the ids of ``stop_tokens`` (None: ``END_OF_TURN``'s tokens in the
    vocabulary), each once."""
    vocab = tokenizer.get_vocab()
    texts = END_OF_TURN if stop_tokens is None else stop_tokens
    missing = [t for t in texts if t not in vocab and stop_tokens is not None]
    if missing:
        raise ValueError(f"stop tokens {missing} are not in the tokenizer's vocabulary")
    ids = [tokenizer.eos_token_id] + [vocab[t] for t in texts if t in vocab]
    return list(dict.fromkeys(i for i in ids if i is not None))


def _write(
    source: Path, folder: Path, chat_template: str | None, stop_tokens: Sequence[str] | None
) -> None:
    """The tokenizer, config, generation config and weights of ``source`` written into
    ``folder`` (weights in float32 shards with an index, as ``save_pretrained`` shards)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    kwargs: dict[str, Any] = {"gguf_file": source.name}
    tokenizer = AutoTokenizer.from_pretrained(source.parent, **kwargs)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    config = AutoConfig.from_pretrained(source.parent, **kwargs)
    config.dtype = torch.float32
    with torch.device("meta"):  # names and shapes only: no weight is allocated
        skeleton = AutoModelForCausalLM.from_config(config)
    tied = _tied_names(skeleton)
    shards: list[list[str]] = []  # the names each shard holds, in order
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        shards.append(sorted(shard))
        save_file(shard, str(folder / f"shard-{len(shards)}.safetensors"), {"format": "pt"})
        shard, size = {}, 0

    for name, weights in hf_compat.gguf_tensors(str(source), skeleton):
        if name in tied:
            continue  # one weight under two names (a tied head): written once, as
            # save_pretrained writes it, and tied again on loading
        if isinstance(weights, hf_compat.Streamed):  # a shard of its own, a slice at a time
            if shard:
                flush()
            shards.append([name])
            total += _write_streamed(folder / f"shard-{len(shards)}.safetensors", name, weights)
            continue
        array = np.ascontiguousarray(weights, dtype=np.float32)
        # float32 tensors come as read-only views of the file: copied, not aliased
        tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
        if size and size + tensor.nbytes > SHARD_BYTES:
            flush()
        shard[name] = tensor
        size, total = size + tensor.nbytes, total + tensor.nbytes
    if shard:
        flush()
    weight_map: dict[str, str] = {}
    for number, names in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        os.rename(folder / f"shard-{number}.safetensors", folder / file)
        weight_map |= dict.fromkeys(names, file)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(folder)
    generation = GenerationConfig.from_model_config(config)
    generation.eos_token_id = stop_ids(tokenizer, stop_tokens)
    generation.save_pretrained(folder)
    _record(folder, formats(read_header(source).tensors))


def _tied_names(model: Any) -> set[str]:
    """The names of ``model``'s parameters that are another's, tied (a head tied to the
    embedding table: the later of each pair in ``named_parameters``' order)."""
    seen: set[int] = set()
    tied = set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            tied.add(name)
        seen.add(id(parameter))
    return tied


def _write_streamed(file: Path, name: str, tensor: hf_compat.Streamed) -> int:
    """``tensor`` written to ``file`` as a safetensors file of it alone (float32), its
    slices as they are dequantized, so the whole tensor is never held; the bytes written.
    The header is the format's: its length (8 bytes, little-endian), then JSON padded with
    spaces to a multiple of 8, then the data."""
    nbytes = 4 * math.prod(tensor.shape)
    entry = {"dtype": "F32", "shape": list(tensor.shape), "data_offsets": [0, nbytes]}
    header = json.dumps({"__metadata__": {"format": "pt"}, name: entry}).encode()
    header += b" " * (-len(header) % 8)
    written = 0
    with open(file, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        for part in tensor.slices():
            data = np.ascontiguousarray(part, dtype=np.float32)
            f.write(data.data.cast("B"))  # its buffer, not a copy
            written += data.nbytes
    if written != nbytes:
        raise RuntimeError(f"{name}: {written} bytes dequantized, {nbytes} expected")
    return nbytes
