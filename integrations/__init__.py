"""Framework adapters (LangChain, LlamaIndex), shipped as ``kvboost_rag.integrations``."""
