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


@pytest.mark.parametrize(
    "alias", [a for a, spec in EMBEDDED_MODELS.items() if spec.chat_template and "qwen" in a]
)
def test_the_template_a_qwen_is_converted_with_shows_a_call_as_json(alias: str) -> None:
    """The template itself, rendered by the 0.5B's tokenizer (which the tests install), so the
    1.5B's is checked where its 22 parts are not installed."""
    from families import family_tokenizer

    tokenizer = family_tokenizer("qwen2.5")
    messages = [{"role": "user", "content": "What is 12 times 7?"}]
    template = EMBEDDED_MODELS[alias].chat_template
    text = tokenizer.apply_chat_template(
        messages, tools=[TOOL], tokenize=False, chat_template=template
    )
    assert EXAMPLE in text and "{{" not in text
