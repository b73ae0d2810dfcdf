"""LangChain's standard chat-model suites against ``ChatKVBoost`` on the embedded SmolLM2.

Tool calling, tool choice, structured output and JSON mode run (the engine decodes calls
and JSON under a grammar). Skipped by the suites themselves (their flags below say why):
image / audio / PDF / video inputs (text-only models), model override per call (one object
serves one loaded model), serialization (an engine holds weights) and VCR cassettes (no
network calls to record).
"""

from __future__ import annotations

from functools import cache
from typing import Any, Literal

import pytest
import torch
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from kvboost_rag import KVBoost
from kvboost_rag.integrations.langchain import ChatKVBoost

# Tests whose tool call needs more than the suite's 24-token budget: a call in Hermes tags
# (``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``) spends ~25 tokens on
# syntax before its arguments. (The suite forbids overriding its tests except to xfail them,
# so the budget is set where the model is built.)
ROOMY_TESTS = {
    "test_tool_choice",
    "test_bind_runnables_as_tools",
    "test_unicode_tool_call_integration",
}
# Every structured-output test asks for a joke about cats: the 135M model's joke strings
# repeat ("a cat is a cat, a cat is a cat, ...") and never close, at 24 as at 96 tokens.
JOKE_REPEATS = (
    "the 135M model's joke string repeats itself and is cut at max_tokens before the JSON "
    "closes (measured at 24 and 96 tokens); the parser then raises"
)


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

    @pytest.fixture
    def model(self, request: pytest.FixtureRequest) -> BaseChatModel:
        room = {"max_tokens": 64} if request.function.__name__ in ROOMY_TESTS else {}
        extra = getattr(request, "param", None) or {}
        params = {**self.standard_chat_model_params, **self.chat_model_params, **room, **extra}
        return self.chat_model_class(**params)

    @property
    def supports_json_mode(self) -> bool:
        return True

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

    # What the 135M model cannot do, however the answer is constrained.

    @pytest.mark.xfail(
        reason="needs the model to call get_weather on its own under tool_choice='auto'; "
        "the 135M model answers in text",
        strict=False,
    )
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model: BaseChatModel) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(reason=JOKE_REPEATS, strict=False)
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    def test_structured_output(
        self, model: BaseChatModel, schema_type: Literal["pydantic", "typeddict", "json_schema"]
    ) -> None:
        super().test_structured_output(model, schema_type)

    @pytest.mark.xfail(reason=JOKE_REPEATS, strict=False)
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    async def test_structured_output_async(
        self, model: BaseChatModel, schema_type: Literal["pydantic", "typeddict", "json_schema"]
    ) -> None:
        await super().test_structured_output_async(model, schema_type)

    @pytest.mark.xfail(reason=JOKE_REPEATS, strict=False)
    def test_structured_output_pydantic_2_v1(self, model: BaseChatModel) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @pytest.mark.xfail(reason=JOKE_REPEATS, strict=False)
    def test_structured_output_optional_param(self, model: BaseChatModel) -> None:
        super().test_structured_output_optional_param(model)

    @pytest.mark.xfail(
        reason="JSON mode constrains the answer to some JSON object, not to the keys the "
        "prompt names: at 24 tokens the object is cut before it closes, and with room the "
        "135M model writes {'setup': ...} without the 'punchline' Joke requires",
        strict=False,
    )
    def test_json_mode(self, model: BaseChatModel) -> None:
        super().test_json_mode(model)
