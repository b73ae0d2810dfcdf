"""Three constrained-decoding libraries, each as a transformers logits processor for one
target (a JSON value under a schema, between fixed text), so the benchmark times them alike.

- llguidance: the engine's own path, ``Constrainer(tokenizer, eos).processor(grammar)`` on
  the grammar ``Structure.grammar()`` builds for the request.
- outlines-core: the Rust core that outlines 1.x builds on, used directly: a ``Vocabulary``
  of the tokenizer's token bytes, ``json_schema.build_regex_from_schema``, one ``Index`` per
  schema (outlines caches it the same way) and one ``Guide`` per request.
- lm-format-enforcer: its transformers integration's tokenizer data, a ``JsonSchemaParser``
  (inside a ``SequenceParser`` for the fixed text) and the prefix-allowed-tokens function,
  applied through transformers' ``PrefixConstrainedLogitsProcessor``.

Each library is imported where used, so the package imports without them.
"""

from __future__ import annotations

import json
import re
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessor

from kvboost_rag.core.tools.formats import FORMATS, Tool, call_schema, strict_schema
from kvboost_rag.core.tools.structure import BitmaskProcessor, Constrainer, Structure

Factory = Callable[[], LogitsProcessor]


@dataclass(frozen=True)
class Target:
    """What an answer must be: ``prefix`` + JSON valid under ``schema`` + ``suffix``;
    ``structure`` is the same request as the engine takes it."""

    name: str
    structure: Structure
    schema: dict[str, Any]
    prefix: str = ""
    suffix: str = ""


def tool_target(name: str, tools: Sequence[Tool]) -> Target:
    """One Hermes-tagged call of any of ``tools`` (tool_choice "required")."""
    fmt = FORMATS["hermes"]
    schema = call_schema(tools, fmt.arguments_key)
    schema.pop("x-guidance")  # llguidance's own options; the grammar is built by Structure
    return Target(name, Structure(tuple(tools), "required", fmt=fmt), schema, fmt.open, fmt.close)


def json_target(name: str, schema: Mapping[str, Any]) -> Target:
    """A JSON answer under ``schema``, made strict as the engine makes it."""
    response_format = {"type": "json_schema", "json_schema": {"schema": dict(schema)}}
    return Target(name, Structure(response_format=response_format), strict_schema(dict(schema)))


class Library(ABC):
    """A constrained-decoding library. ``prepare`` does the per-tokenizer work once;
    ``compile`` the per-schema work a server would cache, and returns a factory of fresh
    per-request processors. Failures raise; ``notes`` records what the adapter had to do."""

    name: str

    def __init__(self) -> None:
        self.notes: list[str] = []

    @abstractmethod
    def prepare(self, tokenizer: Any, eos: Sequence[int]) -> None: ...

    @abstractmethod
    def compile(self, target: Target) -> Factory: ...


class Llguidance(Library):
    name = "llguidance"

    def prepare(self, tokenizer: Any, eos: Sequence[int]) -> None:
        # The first processor builds llguidance's view of the tokenizer, which Constrainer
        # then keeps for the process: so this must run before any constrained request.
        self._constrainer = Constrainer(tokenizer, eos)
        self._constrainer.processor('%llguidance {}\nstart: "x"\n')

    def compile(self, target: Target) -> Factory:
        grammar = target.structure.grammar(self._constrainer.special)
        assert grammar is not None, "a constrained structure has a grammar"
        return lambda: self._constrainer.processor(grammar)


class OutlinesCore(Library):
    name = "outlines-core"

    def __init__(self, whitespace: str = r"[ ]?") -> None:
        super().__init__()
        # outlines' default allows any run of whitespace between tokens; small models then
        # tend to emit whitespace until max_new_tokens. One optional space, as outlines'
        # docs advise, matches the engine's ", " / ": " separators.
        self.whitespace = whitespace
        self.notes.append(f"build_regex_from_schema(whitespace_pattern={whitespace!r})")

    def prepare(self, tokenizer: Any, eos: Sequence[int]) -> None:
        from outlines_core import Vocabulary

        if len(eos) > 1:
            self.notes.append(f"Vocabulary takes one EOS: {eos[0]} of {list(eos)}")
        self._vocabulary = Vocabulary(eos[0], token_bytes(tokenizer))
        self._size = len(tokenizer)

    def compile(self, target: Target) -> Factory:
        from outlines_core import Guide, Index
        from outlines_core.json_schema import build_regex_from_schema

        body = build_regex_from_schema(json.dumps(target.schema), self.whitespace)
        index = Index(literal(target.prefix) + body + literal(target.suffix), self._vocabulary)
        return lambda: GuideProcessor(Guide(index), self._size)


class FormatEnforcer(Library):
    name = "lm-format-enforcer"

    def prepare(self, tokenizer: Any, eos: Sequence[int]) -> None:
        integration = self._integration()
        if [tokenizer.eos_token_id] != list(eos):
            self.notes.append(f"EOS is the tokenizer's {tokenizer.eos_token_id}, not {eos}")
        self._data = integration.build_token_enforcer_tokenizer_data(tokenizer)

    def compile(self, target: Target) -> Factory:
        from lmformatenforcer import JsonSchemaParser, SequenceParser, StringParser
        from transformers import PrefixConstrainedLogitsProcessor

        parts = [StringParser(target.prefix)] if target.prefix else []
        parts.append(JsonSchemaParser(target.schema))
        parts += [StringParser(target.suffix)] if target.suffix else []
        parser = SequenceParser(parts) if len(parts) > 1 else parts[0]
        build = self._integration().build_transformers_prefix_allowed_tokens_fn
        return lambda: PrefixConstrainedLogitsProcessor(build(self._data, parser), num_beams=1)

    def _integration(self) -> Any:
        """lmformatenforcer.integrations.transformers. Release 0.11 imports
        ``PreTrainedTokenizerBase`` from ``transformers.tokenization_utils``, which
        transformers 5 no longer has; it lives in ``tokenization_utils_base``, so alias that
        module and record the failure."""
        try:
            from lmformatenforcer.integrations import transformers as integration
        except ImportError as error:
            import transformers.tokenization_utils_base as base

            cause = error.__context__ or error  # the library re-raises a misleading message
            self.notes.append(f"integration import failed ({cause}); aliased tokenization_utils")
            sys.modules["transformers.tokenization_utils"] = base
            from lmformatenforcer.integrations import transformers as integration
        return integration


LIBRARIES: dict[str, Callable[[], Library]] = {
    "llguidance": Llguidance,
    "outlines-core": OutlinesCore,
    "lm-format-enforcer": FormatEnforcer,
}


class GuideProcessor(BitmaskProcessor):
    """An outlines-core ``Guide`` as a logits processor, on the engine's own masking."""

    def __init__(self, guide: Any, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.guide = guide
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def consume(self, token: int) -> None:
        self.guide.advance(token, return_tokens=False)

    def bitmask(self) -> np.ndarray:
        self.guide.write_mask_into(self._bits.ctypes.data, self._bits.size, 4)
        return self._bits.view(np.uint8)


class TimedProcessor(LogitsProcessor):
    """Wraps a processor and records the wall milliseconds of each call."""

    def __init__(self, inner: LogitsProcessor) -> None:
        self.inner = inner
        self.calls_ms: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = self.inner(input_ids, scores)
        self.calls_ms.append((time.perf_counter() - start) * 1e3)
        return out


def token_bytes(tokenizer: Any) -> dict[bytes, list[int]]:
    """Each regular token's bytes -> its ids, for a byte-level BPE tokenizer (GPT-2,
    Llama 3, SmolLM, Qwen); added and special tokens are left out. ``ValueError`` for
    other tokenizers."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if type(decoder).__name__ != "ByteLevel":
        raise ValueError(f"token_bytes reads byte-level BPE vocabularies only, not {decoder}")
    byte_of = {char: byte for byte, char in _bytes_to_unicode().items()}
    added = set(tokenizer.get_added_vocab().values())
    vocab: dict[bytes, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id not in added:
            vocab.setdefault(bytes(byte_of[c] for c in token), []).append(token_id)
    return vocab


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map of byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = (b for b in range(256) if b not in printable)
    shifted = {b: chr(256 + n) for n, b in enumerate(extra)}
    return {b: chr(b) for b in printable} | shifted


def literal(text: str) -> str:
    """``text`` as a regex matching exactly it. Not ``re.escape``: outlines-core's Rust
    regex reads escapes such as ``\\<`` as word boundaries."""
    return re.sub(r"([\\.+*?()|\[\]{}^$#&\-~])", r"\\\1", text).replace("\n", "\\n")
