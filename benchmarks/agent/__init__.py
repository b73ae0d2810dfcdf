"""bench agent: LangChain / LlamaIndex agent loops, every step re-reading its history."""
