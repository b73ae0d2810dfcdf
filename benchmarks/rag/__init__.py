"""bench rag: RAG workloads against full prefill, and the LangChain / LlamaIndex reuse tables."""
