"""The ``kvboost-rag`` command (``main.main``, the console script; ``python -m
kvboost_rag.cli``), one module per subcommand: ``demo`` (with ``rag_setup`` and ``timing``,
which ``bench load`` and the studies share), ``warm`` (``warm_server`` for ``--server``),
``serve`` and ``models`` (``models`` and ``convert``). ``arguments`` parses and checks
their values, and the benchmark workloads' (``kvboost_rag.bench``, which ``bench`` runs).

Nothing below the command imports it: not the engine (``core``), the adapters
(``integrations``), the server (``kvboost_rag.serve``) nor ``warm_corpus``
(``tests/api/test_layers.py``).
"""
