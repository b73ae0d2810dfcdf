"""``python -m kvboost_rag.cli``: the ``kvboost-rag`` command."""

from kvboost_rag.cli.main import main

main()
