"""LangChain adapters: ``ChatKVBoost`` (chat model), ``KVBoostLLM`` (LLM), the
``KVBoostTextSplitter``, the helpers that mark retrieved documents as passages and
``retriever_tool`` (an agent's retrieval results as marked passages).

Install with ``pip install 'kvboost-rag[langchain]'``.
"""

from kvboost_rag.integrations._common import require

require("langchain_core", "langchain")
require("langchain_text_splitters", "langchain")

from kvboost_rag.integrations.langchain.chat import ChatKVBoost  # noqa: E402
from kvboost_rag.integrations.langchain.documents import (  # noqa: E402
    PASSAGE_DOCUMENT_SEPARATOR,
    KVBoostTextSplitter,
    format_passages,
    passage_document_prompt,
    prompt_prefix,
    stuff_documents_kwargs,
)
from kvboost_rag.integrations.langchain.llm import KVBoostLLM  # noqa: E402
from kvboost_rag.integrations.langchain.tools import retriever_tool  # noqa: E402

__all__ = [
    "PASSAGE_DOCUMENT_SEPARATOR",
    "ChatKVBoost",
    "KVBoostLLM",
    "KVBoostTextSplitter",
    "format_passages",
    "passage_document_prompt",
    "prompt_prefix",
    "retriever_tool",
    "stuff_documents_kwargs",
]
