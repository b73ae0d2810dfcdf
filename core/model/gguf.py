"""GGUF files as model folders: dequantized once by transformers, saved as safetensors.

transformers reads a GGUF (``gguf_file=``) by dequantizing every tensor, which takes 10-60 s
and cannot be saved back with ``save_pretrained`` as loaded. ``convert_gguf`` loads it
dequantized and writes an ordinary model folder (fp32 safetensors: the GGUF's values
exactly, whatever dtype the model then computes in), atomically, once; later loads read
that folder in seconds. ``converted_folder`` keeps one such folder per GGUF file in the
cache root.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvboost_rag.core.errors import UnknownModelError

GGUF_MAGIC = b"GGUF"

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
    existing ``out`` is left as it is. ``UnknownModelError`` when ``gguf`` is not a GGUF
    file."""
    source, target = Path(gguf).expanduser(), Path(out).expanduser()
    if not is_gguf(source):
        raise UnknownModelError(f"{str(gguf)!r} is not a GGUF file (it does not start with GGUF)")
    if (target / "model.safetensors").exists() or (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model, tokenizer = _dequantized(source)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        model.generation_config.eos_token_id = stop_ids(tokenizer, stop_tokens)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; a model folder is shared like any other
        try:
            os.rename(tmp, target)  # atomic; a concurrent converter may have won the race
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


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


def _dequantized(source: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    kwargs: dict[str, Any] = {"gguf_file": source.name}
    tokenizer = AutoTokenizer.from_pretrained(source.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        source.parent,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
        **kwargs,
    )
    return model, tokenizer
