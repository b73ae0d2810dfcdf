"""Trace one warmed RAG request through ``core``: which files it runs code in and how often
it switches between core's folders (a call or a return that crosses from one to another).

    .venv/bin/python scripts/trace_request.py [OUT.json]

Runs on the tests' tiny random Llama with the SmolLM2 tokenizer (no download): an engine
at the default fidelity warms two passages, then answers one prompt holding both (4
tokens); only that request is traced, on the thread that runs it (``max_batch_size=1``, so
the caller's thread runs the executor's loop). Prints the file count, the switches, and the
files in the order first entered."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import make_model, make_tokenizer  # noqa: E402

from kvboost_rag import KVBoost, KVBoostConfig  # noqa: E402

PASSAGES = [
    "The lighthouse keeper logs the weather at dawn and dusk, every day of the year.",
    "Copper conducts heat far better than stainless steel does, so pans use both.",
]


def unit(path: str) -> str | None:
    """The folder of core a file is in ("engine" for a top-level module); None outside."""
    marker = "/core/"
    if marker not in path or "/site-packages/" in path:
        return None
    parts = path.split(marker, 1)[1].split("/")
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def trace(engine: KVBoost, prompt: str) -> dict[str, Any]:
    files: list[str] = []
    switches = 0
    pairs: dict[str, int] = {}
    last: list[str | None] = [None]

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal switches
        if event not in ("call", "return"):
            return
        path = frame.f_code.co_filename
        here = unit(path)
        if here is None:
            return
        short = path.split("/core/", 1)[1]
        if short not in files:
            files.append(short)
        if last[0] is not None and here != last[0]:
            switches += 1
            pair = " <-> ".join(sorted((last[0], here)))
            pairs[pair] = pairs.get(pair, 0) + 1
        last[0] = here

    sys.setprofile(profile)
    try:
        engine.generate(prompt, max_new_tokens=4)
    finally:
        sys.setprofile(None)
    folders = sorted({unit("/core/" + f) for f in files} - {None})  # type: ignore[type-var]
    pairs = dict(sorted(pairs.items(), key=lambda item: -item[1]))
    return {
        "files": len(files),
        "folders": folders,
        "switches": switches,
        "pairs": pairs,
        "order": files,
    }


def main() -> None:
    config = KVBoostConfig(block_tokens=8, max_batch_size=1, draft_tokens=0)
    engine = KVBoost(make_model("llama"), make_tokenizer(), config)
    engine.warm_passages(PASSAGES)
    prompt = "Notes:\n\n" + "\n\n".join(PASSAGES) + "\n\nWhat does copper do?"
    engine.generate(prompt, max_new_tokens=4)  # first use: measurements, compiles
    engine.generate("Unrelated warm-up prompt.", max_new_tokens=2)
    assert threading.current_thread() is threading.main_thread()
    result = trace(engine, prompt)
    counts = result["files"], len(result["folders"]), result["switches"]
    print("files {}, folders {}, switches {}".format(*counts))
    print("folders: " + ", ".join(result["folders"]))
    print("switches by pair: " + ", ".join(f"{k} {v}" for k, v in result["pairs"].items()))
    for name in result["order"]:
        print("  " + name)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
