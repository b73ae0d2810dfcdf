"""What only the studies share: local Redis servers and clusters, the cold-start run. The
helpers ``kvboost-rag bench`` uses too live in ``kvboost_rag.bench.common``."""
