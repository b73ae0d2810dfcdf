"""LlamaIndex adapter: ``KVBoostLLM`` for any query engine and agent (a function-calling
LLM: ``FunctionAgent``, ``structured_predict``), ``passage_query_engine`` so every response
mode hands it whole retrieved nodes as reusable passages, ``retriever_tool`` so an agent's
retrieved nodes are reusable passages too, and ``KVBoostNodeParser`` so nodes are the
engine's KV units.

Needs ``pip install 'kvboost-rag[llamaindex]'``.
"""

from kvboost_rag.integrations._common import require

require("llama_index", "llamaindex")

from kvboost_rag.integrations.llamaindex.llm import KVBoostLLM  # noqa: E402
from kvboost_rag.integrations.llamaindex.node_parser import KVBoostNodeParser  # noqa: E402
from kvboost_rag.integrations.llamaindex.prefix import query_engine_prefix  # noqa: E402
from kvboost_rag.integrations.llamaindex.prompt_helper import PassagePromptHelper  # noqa: E402
from kvboost_rag.integrations.llamaindex.retriever_tool import (  # noqa: E402
    PassageRetrieverTool,
    retriever_tool,
)
from kvboost_rag.integrations.llamaindex.synthesis import (  # noqa: E402
    RESPONSE_MODES,
    PassageSynthesizer,
    mark_nodes,
    passage_query_engine,
    passage_synthesizer,
)

__all__ = [
    "RESPONSE_MODES",
    "KVBoostLLM",
    "KVBoostNodeParser",
    "PassagePromptHelper",
    "PassageRetrieverTool",
    "PassageSynthesizer",
    "mark_nodes",
    "passage_query_engine",
    "passage_synthesizer",
    "query_engine_prefix",
    "retriever_tool",
]
