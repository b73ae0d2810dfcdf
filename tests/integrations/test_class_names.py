"""Each public class has a name of its own: LangChain's LLM is ``KVBoostPipeline``
(``HuggingFacePipeline``'s counterpart), LlamaIndex's is ``KVBoostLLM``
(``HuggingFaceLLM``'s); the old LangChain name says where each went."""

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")


def test_no_two_public_classes_share_a_name() -> None:
    from kvboost_rag.integrations import langchain, llamaindex

    mine = {n for n in langchain.__all__ if isinstance(getattr(langchain, n), type)}
    theirs = {n for n in llamaindex.__all__ if isinstance(getattr(llamaindex, n), type)}
    assert not mine & theirs


def test_the_old_llm_name_says_where_each_class_is() -> None:
    from kvboost_rag.integrations import langchain

    with pytest.raises(ImportError, match="KVBoostPipeline now.*KVBoostLLM is the LlamaIndex"):
        langchain.KVBoostLLM  # noqa: B018
    with pytest.raises(ImportError, match="KVBoostPipeline now"):
        from kvboost_rag.integrations.langchain import KVBoostLLM  # noqa: F401
