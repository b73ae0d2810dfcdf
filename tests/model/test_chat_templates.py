"""The chat templates the embedded models are converted with: each Qwen2.5-Coder model's
tool instructions show a call as the model is to write one. The 1.5B's GGUF doubled the
example's braces (``{{"name": ...}}``) and the model copied them."""

import pytest
from transformers import AutoTokenizer

from kvboost_rag.core.model.embedded import EMBEDDED_MODELS, embedded_available
from kvboost_rag.core.model.loading import resolve_model_path

TOOL = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
    },
}
EXAMPLE = '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'


@pytest.mark.embedded
@pytest.mark.parametrize("alias", ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"])
def test_qwen_tool_instructions_show_a_call_as_json(alias: str) -> None:
    if not embedded_available(alias):
        pytest.skip(f"needs the model's packages: {EMBEDDED_MODELS[alias].install}")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(alias))
    messages = [{"role": "user", "content": "What is 12 times 7?"}]
    text = tokenizer.apply_chat_template(messages, tools=[TOOL], tokenize=False)
    assert EXAMPLE in text
