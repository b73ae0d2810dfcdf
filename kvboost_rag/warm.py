"""``warm_corpus()``: preload a whole document collection's passage KV."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from kvboost_rag.core.engine import KVBoost


@dataclass(frozen=True)
class WarmReport:
    documents: int
    passages: int  # pieces after splitting long documents at sentences
    tokens: int
    cached: int  # pieces already cached (memory or disk) before this call
    new: int  # pieces encoded and stored by this call
    bytes: int  # KV bytes of all pieces
    seconds: float
    tokens_per_s: float  # all tokens (cached ones included) over the wall time


def warm_corpus(
    target: Any,
    documents: Iterable[Any],
    *,
    batch_size: int | None = None,
    progress: bool = True,
) -> WarmReport:
    """Encode every document's passage KV once, so prompts that retrieve them reuse it.

    ``target`` is a ``KVBoost`` engine or an object holding one as ``.engine`` (the
    package's LangChain / LlamaIndex classes). ``documents`` are strings, LangChain
    ``Document``s (``page_content``) or LlamaIndex nodes / documents (``get_content()``).
    Each document goes through the same chunker as prompts, laid out as
    ``format_passages`` lays out retrieved passages. With ``cache_dir`` set the KV is
    written through to disk. Raises ``TypeError`` for an unknown target or document.
    """
    engine = _engine(target)
    texts = [document_text(doc, i) for i, doc in enumerate(documents)]
    start = time.perf_counter()
    # One call over the whole corpus, so encoding batches group similar lengths globally.
    with tqdm(unit="passage", disable=not progress, desc="encoding") as bar:
        r = engine.warm_passages(texts, batch_size=batch_size, progress=bar.update)
    seconds = time.perf_counter() - start
    rate = r.tokens / seconds if seconds else 0.0
    return WarmReport(len(texts), r.passages, r.tokens, r.cached, r.encoded, r.bytes, seconds, rate)


def _engine(target: Any) -> KVBoost:
    engine = target if isinstance(target, KVBoost) else getattr(target, "engine", None)
    if not isinstance(engine, KVBoost):
        raise TypeError(
            f"warm_corpus needs a KVBoost engine or an object with one as .engine, "
            f"got {type(target).__name__}"
        )
    return engine


def document_text(doc: Any, index: int) -> str:
    """The text of one document: a str, a LangChain Document or a LlamaIndex node."""
    if isinstance(doc, str):
        text = doc
    elif isinstance(getattr(doc, "page_content", None), str):
        text = doc.page_content
    elif callable(getattr(doc, "get_content", None)):
        text = doc.get_content()
    else:
        raise TypeError(
            f"documents[{index}] is a {type(doc).__name__}: pass strings, LangChain "
            "Documents or LlamaIndex nodes"
        )
    if not text:
        raise ValueError(f"documents[{index}] is empty")
    return text


__all__: Sequence[str] = ["WarmReport", "document_text", "warm_corpus"]
