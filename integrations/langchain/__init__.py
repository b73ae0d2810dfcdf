"""LangChain adapters: ``ChatKVBoost`` (chat model), ``KVBoostPipeline`` (LLM), the
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
from kvboost_rag.integrations.langchain.llm import KVBoostPipeline  # noqa: E402
from kvboost_rag.integrations.langchain.tools import retriever_tool  # noqa: E402

__all__ = [
    "PASSAGE_DOCUMENT_SEPARATOR",
    "ChatKVBoost",
    "KVBoostPipeline",
    "KVBoostTextSplitter",
    "format_passages",
    "passage_document_prompt",
    "prompt_prefix",
    "retriever_tool",
    "stuff_documents_kwargs",
]


def __getattr__(name: str) -> object:
    if name == "KVBoostLLM":  # its name before 0.2: LlamaIndex's LLM class shares it
        # ImportError, so `from ... import KVBoostLLM` shows this message, not a bare one.
        raise ImportError(
            "the LangChain LLM is KVBoostPipeline now (HuggingFacePipeline's counterpart, as "
            "ChatKVBoost is ChatHuggingFace's); KVBoostLLM is the LlamaIndex LLM, in "
            "kvboost_rag.integrations.llamaindex"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
