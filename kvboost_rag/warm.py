"""``warm_corpus()``: preload a whole document collection's passage KV."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tqdm.auto import tqdm

from kvboost_rag.core.engine import KVBoost
from kvboost_rag.core.result import WarmResult


def warm_corpus(
    target: Any,
    documents: Iterable[Any],
    *,
    batch_size: int | None = None,
    progress: bool = True,
) -> WarmResult:
    """Encode every document's passage KV once, so prompts that retrieve them reuse it.

    ``target`` is a ``KVBoost`` engine or an object holding one as ``.engine`` (the
    package's LangChain / LlamaIndex classes). ``documents`` are strings, LangChain
    ``Document``s (``page_content``) or LlamaIndex nodes / documents (``get_content()``).
    Each document is one passage (long ones split at sentences, as in prompts), whatever
    layout later prompts put around it. With ``cache_dir`` set the KV is written through
    to disk. Raises ``TypeError`` for an unknown target or document.
    """
    engine = KVBoost.of(target)
    texts = [document_text(doc, i) for i, doc in enumerate(documents)]
    # One call over the whole corpus, so encoding batches group similar lengths globally.
    with tqdm(unit="passage", disable=not progress, desc="encoding") as bar:
        return engine.warm_passages(texts, batch_size=batch_size, progress=bar.update)


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


__all__: Sequence[str] = ["document_text", "warm_corpus"]
