"""LangChain's ``ChatOpenAI`` against a real ``kvboost-rag serve`` process: invoke, stream,
tools, structured output and a retrieval chain, with the in-process engine's greedy
answers where the prompt is the same."""

from __future__ import annotations

import pytest
from server_process import ServerProcess

from kvboost_rag import KVBoost

pytestmark = pytest.mark.embedded
langchain_openai = pytest.importorskip("langchain_openai")

from langchain_core.embeddings import DeterministicFakeEmbedding  # noqa: E402
from langchain_core.output_parsers import StrOutputParser  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import RunnablePassthrough  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

KEY = "langchain-key-0123"
MODEL = "smollm2-135m-instruct"
QUESTION = "What is the capital of France? Answer in one word."
DOCS = [
    "The Loire is the longest river in France, flowing 1,006 kilometres to the Atlantic.",
    "Mont Blanc, at 4,806 metres, is the highest mountain of the Alps.",
    "Lyon sits where the Rhone and the Saone rivers meet.",
]


class City(BaseModel):
    """A city."""

    city: str = Field(max_length=20, description="the city's name")


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    with ServerProcess(MODEL, "--dtype", "float32", "--api-key", KEY) as process:
        yield process


@pytest.fixture(scope="module")
def chat(server: ServerProcess):
    return langchain_openai.ChatOpenAI(
        base_url=server.url, api_key=KEY, model=MODEL, max_tokens=12, max_retries=0, timeout=120
    )


def test_invoke_and_stream_answer_as_the_engine_does(chat, embedded: KVBoost) -> None:
    here = embedded.chat([{"role": "user", "content": QUESTION}], max_new_tokens=12)
    assert chat.invoke(QUESTION).content == here.text and here.text
    assert "".join(chunk.content for chunk in chat.stream(QUESTION)) == here.text


def test_bind_tools_gets_a_tool_call(chat) -> None:
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "sunny"

    tooled = chat.bind_tools([get_weather], tool_choice="required")
    reply = tooled.invoke("What is the weather in Paris?", max_tokens=40)
    assert [call["name"] for call in reply.tool_calls] == ["get_weather"]
    assert isinstance(reply.tool_calls[0]["args"]["city"], str)


def test_with_structured_output_gives_the_schema(chat) -> None:
    structured = chat.with_structured_output(City, method="json_schema")
    answer = structured.invoke("Name a city in Italy.", max_tokens=40)
    assert isinstance(answer, City) and answer.city


def test_a_retrieval_chain_answers_as_the_engine_does(chat, embedded: KVBoost) -> None:
    store = InMemoryVectorStore.from_texts(DOCS, DeterministicFakeEmbedding(size=16))
    retriever = store.as_retriever(search_kwargs={"k": 2})
    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", "Answer from the documents."),
            ("human", "{context}\n\nQuestion: {question}"),
        ]
    )

    def join(documents: list) -> str:
        return "\n\n".join(document.page_content for document in documents)

    rag = {"context": retriever | join, "question": RunnablePassthrough()}
    answer = (rag | prompt | chat | StrOutputParser()).invoke("Which river is the longest?")
    question = "Which river is the longest?"
    context = join(retriever.invoke(question))
    messages = [
        {"role": "system", "content": "Answer from the documents."},
        {"role": "user", "content": f"{context}\n\nQuestion: {question}"},
    ]
    here = embedded.chat(messages, max_new_tokens=12)
    assert answer == here.text and here.text
