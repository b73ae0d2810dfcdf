"""``KVBoostNodeParser``: nodes cut where the engine caches, so a node is one KV unit."""

from __future__ import annotations

from typing import Any

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.node_parser import TextSplitter

from kvboost_rag.core.engine import KVBoost
from kvboost_rag.integrations._common import split_into_units


class KVBoostNodeParser(TextSplitter):
    """Split documents with the engine's own chunker: at sentence boundaries, each node
    small enough that the engine caches it whole (its passage separator included).

    The pieces of a document join back to its text. A node retrieved later is then exactly
    one cached passage, and ``warm_corpus(llm, nodes)`` warms what queries will reuse.
    Usable in ``IngestionPipeline(transformations=[...])`` and ``transformations=``.
    """

    max_passage_tokens: int = Field(
        default=512, gt=0, description="Most tokens per node, separator included."
    )
    tokenizer_name: str = Field(
        default="", description="The tokenizer's name (part of the ingestion cache key)."
    )

    _tokenizer: Any = PrivateAttr()

    def __init__(self, tokenizer: Any, max_passage_tokens: int = 512, **fields: Any) -> None:
        if not callable(tokenizer):
            raise TypeError(
                "tokenizer must be a Hugging Face tokenizer (callable on text); use "
                "KVBoostNodeParser.from_engine(engine) to take the engine's"
            )
        fields.setdefault("tokenizer_name", str(getattr(tokenizer, "name_or_path", "")))
        super().__init__(max_passage_tokens=max_passage_tokens, **fields)  # type: ignore[call-arg]
        self._tokenizer = tokenizer

    @classmethod
    def from_engine(cls, target: Any, **fields: Any) -> KVBoostNodeParser:
        """The tokenizer and ``max_passage_tokens`` of an engine, or of an object holding
        one as ``.engine`` (``KVBoostLLM``)."""
        engine = KVBoost.of(target)
        fields.setdefault("max_passage_tokens", engine.config.max_passage_tokens)
        return cls(engine.tokenizer, **fields)

    @classmethod
    def class_name(cls) -> str:
        return "KVBoostNodeParser"

    def split_text(self, text: str) -> list[str]:
        return split_into_units(text, self._tokenizer, self.max_passage_tokens)
