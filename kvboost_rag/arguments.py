"""Moved to ``kvboost_rag.cli.arguments``. Kept for ``benchmarks/weights/run.py`` alone, whose
import moves with its next change; then this module goes (``tests/api/test_layers.py``
names it as the one importer left)."""

from kvboost_rag.cli.arguments import ArgumentParser

__all__ = ["ArgumentParser"]
