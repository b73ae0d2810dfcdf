"""What a request asks of the answer's form (tools it may call, a JSON shape), and the
constrained decoding that makes the answer take that form.

Constraints are llguidance grammars applied as a transformers logits processor: the same
processor masks the first token (picked from the repair pass's logits on the reused-KV path)
and every token ``generate`` produces after it. llguidance was chosen by measurement
against outlines-core and lm-format-enforcer (``python -m benchmarks.constrained``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessor

from kvboost_rag.core.tools.bare import bare_calls, bare_start, fitted
from kvboost_rag.core.tools.formats import (
    CANONICAL_JSON,
    FORMATS,
    InvalidToolCall,
    Parsed,
    SpecialToken,
    Tool,
    ToolFormat,
    check_schema,
    parameters_of,
    strict_schema,
    tool_name,
)
from kvboost_rag.core.tools.template import check_tools

TOOL_CHOICES = ("auto", "required", "none")
# An answer whose calls are refused (``tool_choice="none"``, the repeat guard's retry): text
# that is not empty and holds no call, neither in the format's tags (as text; a tag that is
# a special token no text matches) nor as bare or fenced JSON (no ``{"`` at all), and it
# opens with none of ``{[`(<>"'``: told to answer in text, Qwen2.5-Coder-0.5B wrote its call
# with a mismatched quote, as "function-name", in an xml fence, as <name> tags, then after
# a ">", each time the grammar refused the form before.
TEXT_ONLY = (
    "%llguidance {}\nstart: TEXT\n"
    r'TEXT: /(?s:\s*[^\s{\[`(<>"\'].*)/'
    r' & ~/(?s:.*)(\{\s*["\']|["\']name["\']\s*:|["\']arguments|```\s*json|<tool_call>)(?s:.*)/'
    "\n"
)
ResponseFormat = Mapping[str, Any]  # {"type": "json_object"} or {"type": "json_schema", ...}


@dataclass(frozen=True)
class Structure:
    """Tools offered and how they may be used, or a JSON answer format; empty by default
    (plain text). ``tool_choice``: "auto" (text or calls), "required" (calls only), "none"
    (text only: the grammar refuses calls, which are not parsed either; the tools stay in
    the prompt) or a tool's name (exactly that tool).
    ``response_format``: ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {"schema": {...}}}``. ``constrain``: decode under a grammar.
    ``parallel``: several calls in one answer (else the grammar ends it after one)."""

    tools: tuple[Tool, ...] = ()
    tool_choice: str = "auto"
    response_format: Mapping[str, Any] | None = None
    constrain: bool = True
    fmt: ToolFormat = field(default_factory=lambda: FORMATS["hermes"])
    parallel: bool = False

    def __post_init__(self) -> None:
        for name, flag in (("constrain", self.constrain), ("parallel_tool_calls", self.parallel)):
            if not isinstance(flag, bool):  # "no" would read as True
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        names = check_tools(self.tools)
        choice = self.tool_choice
        if choice not in TOOL_CHOICES and choice not in names:
            raise ValueError(
                f"tool_choice must be one of {TOOL_CHOICES} or a tool's name {names}, got "
                f"{choice!r}"
            )
        if not self.tools and (choice != "auto" or self.parallel):
            raise ValueError("tool_choice and parallel_tool_calls need tools=")
        if self.response_format is not None:
            if self.tools:
                raise ValueError("pass tools= or response_format=, not both")
            json_schema(self.response_format)  # validates

    @property
    def names(self) -> list[str]:
        return [tool_name(t) for t in self.tools]

    @property
    def calls_parsed(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def grammar(self, special: SpecialToken) -> str | None:
        """The llguidance grammar decoding follows; None when unconstrained. ``special``:
        the tokenizer's special token spelling a format's tag (``Constrainer.special``)."""
        if not self.constrain:
            return None
        if self.response_format is not None:
            from llguidance import LLMatcher

            schema = strict_schema(json_schema(self.response_format))
            return LLMatcher.grammar_from_json_schema(schema, defaults=CANONICAL_JSON)
        if not self.tools:
            return None
        if self.tool_choice == "none":
            return TEXT_ONLY
        if self.tool_choice == "auto":
            return self.fmt.grammar(self.tools, False, self.parallel, special)
        chosen = [t for t in self.tools if tool_name(t) == self.tool_choice] or self.tools
        return self.fmt.grammar(chosen, True, self.parallel, special)

    def parse(self, text: str) -> Parsed:
        """The answer's content and calls: in the format's tags, else written as bare or
        fenced JSON (``bare``). Under a forced call (``tool_choice`` "required" or a tool's
        name) an answer holding no call is an invalid call, not content: it was cut before
        the call's opening tag was whole (at max_tokens), or an unconstrained model wrote
        text instead."""
        if not self.calls_parsed:
            return Parsed(text, [], [])
        parsed = self.fmt.parse(text, self.names)
        if not parsed.calls and not parsed.invalid:
            bare = bare_calls(text, self.names)
            if bare is not None:  # free text: its arguments fitted to the schemas
                schemas = {tool_name(t): parameters_of(t) for t in self.tools}
                parsed = Parsed(bare.content, fitted(bare.calls, schemas), bare.invalid)
        if not self.parallel and parsed.calls and len(parsed.calls) + len(parsed.invalid) > 1:
            # One call per answer, as the grammar allows in the tags: a small model's bare
            # calls, one a line, went on to other tools and back (Qwen2.5-Coder-0.5B)
            parsed = Parsed(parsed.content, parsed.calls[:1], [])
        if self.tool_choice == "auto" or parsed.calls or parsed.invalid:
            return parsed
        name = self.tool_choice if self.tool_choice in self.names else None
        why = f"tool_choice={self.tool_choice!r} asks for a call and the answer holds none"
        return Parsed("", [], [InvalidToolCall(name, text, f"{why}: {text!r}")])

    def visible(self, text: str) -> str:
        """What of a growing answer may be streamed as content: up to a call being
        written, in the format's tags or as bare or fenced JSON."""
        if not self.calls_parsed:
            return text
        shown = self.fmt.visible(text)
        return shown[: bare_start(shown, self.names)]


def json_schema(response_format: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON schema a ``response_format`` asks for (``{"type": "object"}`` for JSON mode)."""
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        inner = response_format.get("json_schema") or {}
        schema = inner.get("schema") if isinstance(inner, Mapping) else None
        if isinstance(schema, Mapping):
            check_schema(schema, "response_format's schema")
            return dict(schema)
    raise ValueError(
        "response_format must be {'type': 'json_object'} or {'type': 'json_schema', "
        f"'json_schema': {{'schema': {{...}}}}}}, got {response_format!r}"
    )


class BitmaskProcessor(LogitsProcessor):
    """Masks every token a matcher does not allow next. Stateful: it feeds the matcher
    the tokens generated since its first call (that call's length is the prompt), so it
    serves one request, first token and ``generate`` alike. Subclasses say how a token
    is consumed and where the allowed-token bitmask (32-bit words, little-endian) is."""

    def __init__(self, vocab_size: int) -> None:
        self._vocab = vocab_size
        self._start: int | None = None
        self._consumed = 0

    def consume(self, token: int) -> None:
        raise NotImplementedError

    def bitmask(self) -> np.ndarray:
        """The allowed next tokens as packed bits, in a uint8 array."""
        raise NotImplementedError

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        ids = input_ids[0].tolist()
        if self._start is None:
            self._start = len(ids)
        for token in ids[self._start + self._consumed :]:
            self.consume(token)
            self._consumed += 1
        allowed = np.unpackbits(self.bitmask(), bitorder="little")[: self._vocab].astype(bool)
        mask = torch.ones(scores.shape[-1], dtype=torch.bool)
        mask[: allowed.size] = ~torch.from_numpy(allowed)
        return scores.masked_fill(mask.to(scores.device), float("-inf"))


class GrammarProcessor(BitmaskProcessor):
    """An llguidance ``LLMatcher`` as a logits processor."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.matcher = matcher

    def consume(self, token: int) -> None:
        self.matcher.consume_token(token)

    def bitmask(self) -> np.ndarray:
        if self.matcher.is_error():
            raise RuntimeError(f"constrained decoding failed: {said(self.matcher.get_error())}")
        return np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)


class Constrainer:
    """Builds grammar processors for one tokenizer (its llguidance view is built once)."""

    def __init__(self, tokenizer: Any, eos: Sequence[int]) -> None:
        self._hf = tokenizer
        self._eos = list(eos)
        self._tokenizer: Any = None
        self._special: dict[str, int] | None = None  # added tokens llguidance keeps apart
        self._lock = threading.Lock()

    def processor(self, grammar: str) -> GrammarProcessor:
        """A fresh processor for ``grammar``; ``ValueError`` when llguidance rejects it."""
        from llguidance import LLMatcher

        tokenizer = self._llg_tokenizer()
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(
                f"cannot constrain decoding to this format: {said(matcher.get_error())}"
            )
        return GrammarProcessor(matcher, tokenizer.vocab_size)

    def special(self, text: str) -> int | None:
        """The id of the special token spelling ``text`` in llguidance's view of the
        tokenizer (which no text literal in a grammar matches), or None."""
        self._llg_tokenizer()
        assert self._special is not None  # built with the view
        return self._special.get(text)

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                view = _shared_tokenizer(self._hf, tuple(self._eos))
                added = self._hf.get_added_vocab().items()
                self._special = {t: int(i) for t, i in added if view.is_special_token(i)}
                self._tokenizer = view
            return self._tokenizer


def said(error: str) -> str:
    """An llguidance error's first line: some go on with the parser's statistics as JSON,
    hundreds of lines a client was sent whole (issue 64)."""
    line = error.strip().splitlines()[0] if error.strip() else "no reason given"
    return line if len(line) <= 300 else line[:297] + "..."


_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], Any]] = (
    weakref.WeakKeyDictionary()
)


def _shared_tokenizer(hf_tokenizer: Any, eos: tuple[int, ...]) -> Any:
    """llguidance's view of a HF fast tokenizer (about 0.4 s to build, so one per
    tokenizer)."""
    try:
        import llguidance.hf
    except ImportError as error:  # pragma: no cover - llguidance is a dependency
        raise ImportError(
            "constrained decoding needs llguidance: pip install llguidance"
        ) from error
    views = _TOKENIZERS.setdefault(hf_tokenizer, {})
    if eos not in views:
        views[eos] = llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=list(eos))
    return views[eos]
