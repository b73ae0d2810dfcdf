"""``retriever_tool``: a retriever as an agent's tool whose output is the retrieved nodes as
marked passages, so each node's KV is reused wherever a tool result puts it, in every step
of every agent run (and warmed ahead with ``warm_corpus(llm, nodes)``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.bridge.pydantic import BaseModel, Field
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.core.tools import RetrieverTool, ToolMetadata, ToolOutput

from kvboost_rag.integrations._common import documents_as_passages

DEFAULT_DESCRIPTION = "Look up passages about a query in the knowledge base."


class RetrieverQuery(BaseModel):
    """The tool's one argument."""

    query: str = Field(description="A few words to look up.", max_length=100)


class PassageRetrieverTool(RetrieverTool):
    """A ``RetrieverTool`` taking ``query`` whose content is the nodes' texts as marked
    passages, laid out as ``documents_as_passages`` lays them out; ``raw_output`` is
    the retrieved nodes (after the postprocessors)."""

    def call(self, *args: Any, **kwargs: Any) -> ToolOutput:
        query = _query(args, kwargs)
        nodes = self.retriever.retrieve(query)
        return self._output(query, self._apply_node_postprocessors(nodes, QueryBundle(query)))

    async def acall(self, *args: Any, **kwargs: Any) -> ToolOutput:
        query = _query(args, kwargs)
        nodes = await self.retriever.aretrieve(query)
        bundle = QueryBundle(query)
        return self._output(query, await self._async_apply_node_postprocessors(nodes, bundle))

    def _output(self, query: str, nodes: list[NodeWithScore]) -> ToolOutput:
        return ToolOutput(
            content=documents_as_passages(nodes),
            tool_name=self.metadata.get_name(),
            raw_input={"query": query},
            raw_output=nodes,
        )


def retriever_tool(
    retriever: BaseRetriever,
    name: str = "retrieve",
    description: str = DEFAULT_DESCRIPTION,
    node_postprocessors: Sequence[BaseNodePostprocessor] | None = None,
) -> PassageRetrieverTool:
    """``retriever`` as a tool an agent calls with ``{"query": ...}``; its output marks
    each retrieved node as a passage, so the engine reuses the node's cached KV."""
    metadata = ToolMetadata(name=name, description=description, fn_schema=RetrieverQuery)
    return PassageRetrieverTool(retriever, metadata, list(node_postprocessors or []))


def _query(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The query, passed by name or (as LlamaIndex calls one-argument tools) by position."""
    given = [*args, *kwargs.values()]
    if len(given) != 1 or set(kwargs) - {"query"} or not isinstance(given[0], str):
        raise ValueError(
            f"a retriever tool takes one string, query=...; got args={args!r}, kwargs={kwargs!r}"
        )
    return given[0]
