"""The kvboost-rag engine (shipped as ``kvboost_rag.core``)."""
