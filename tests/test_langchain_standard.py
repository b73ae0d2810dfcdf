"""LangChain's standard chat-model suites against ``ChatKVBoost`` on the embedded SmolLM2.

Skipped by the suites themselves (their flags below say why): tool calling, tool choice,
structured output and JSON mode (the engine has no tool or schema-constrained decoding),
image / audio / PDF / video inputs (text-only models), model override per call (one object
serves one loaded model), serialization (an engine holds weights) and VCR cassettes (no
network calls to record).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
from langchain_core.messages import AIMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from kvboost_rag import KVBoost
from kvboost_rag.integrations.langchain import ChatKVBoost


@cache
def shared_engine() -> KVBoost:
    """One model for every test: the suites build many ChatKVBoost objects."""
    return KVBoost.from_pretrained("smollm2-135m-instruct", dtype=torch.float32)


class TestChatKVBoostUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatKVBoost]:
        return ChatKVBoost

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"engine": shared_engine()}

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        # api_key, timeout and max_retries configure network clients; a local model has
        # none, and ChatKVBoost rejects fields it would ignore (extra="forbid").
        params = dict(super().standard_chat_model_params)
        for network_only in ("api_key", "timeout", "max_retries"):
            params.pop(network_only, None)
        return params


@pytest.mark.embedded
class TestChatKVBoostIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatKVBoost]:
        return ChatKVBoost

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"engine": shared_engine(), "max_tokens": 24}

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[Any]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """A long system prompt asked twice: the second request reads it from the cache."""
        model = ChatKVBoost(engine=shared_engine(), max_tokens=4)
        system = "You are a careful assistant. " * 40
        messages = [("system", system), ("human", "Say hi.")]
        model.invoke(messages)
        if stream:
            full: Any = None
            for chunk in model.stream(messages):
                full = chunk if full is None else full + chunk
            message = full
        else:
            message = model.invoke(messages)
        details = message.usage_metadata["input_token_details"]
        assert details["cache_read"] >= len(model.get_token_ids(system)), details
        return message
