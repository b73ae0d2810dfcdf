"""One measurement of ``benchmarks.weights`` in a process of its own; prints one JSON line.

probe.py first MODEL KIND | engine MODEL KIND | transformers MODEL
         | convert MODEL [KIND] | folder MODEL OUT
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def memory() -> dict[str, int]:
    status = Path("/proc/self/status").read_text().splitlines()
    field = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in status if "kB" in line}
    # of the resident set, pages mapped from files (the page cache's: a mapped blocks cache)
    return {"rss": field["VmRSS"], "peak": field["VmHWM"], "rss_file": field["RssFile"]}


def first(model: str, kind: str) -> dict[str, int]:
    """A start in a process of its own before the measured one: what is cached, cached (in
    the measured process it would stay mapped, and count twice)."""
    from kvboost_rag import KVBoost

    KVBoost.from_pretrained(model, weights=kind)
    return memory()


def engine(model: str, kind: str) -> dict[str, float]:
    from kvboost_rag import KVBoost

    imported(model)
    start = time.perf_counter()
    engine = KVBoost.from_pretrained(model, weights=kind)
    seconds = time.perf_counter() - start
    engine.chat([{"role": "user", "content": "Hi"}], max_new_tokens=2)  # a request runs
    return {"start_s": seconds, **memory()}


def imported(model: str) -> None:
    """The model's transformers modules imported (its class built on the meta device), as
    transformers' own start has them from the load before its timed one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvboost_rag.core.model.loading import resolve_model_path

    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve_model_path(model)))


def transformers_start(model: str) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvboost_rag.core.model.loading import default_dtype, resolve_model_path

    folder = resolve_model_path(model)
    AutoModelForCausalLM.from_pretrained(folder)  # files in the page cache, as for the engine
    start = time.perf_counter()
    AutoTokenizer.from_pretrained(folder)
    AutoModelForCausalLM.from_pretrained(folder, dtype=default_dtype(torch.device("cpu")))
    return {"start_s": time.perf_counter() - start, **memory()}


def convert(model: str, kind: str | None = None) -> dict[str, float]:
    from kvboost_rag import KVBoost
    from kvboost_rag.core.model.embedded import gguf_path
    from kvboost_rag.core.model.loading import default_cache_root

    gguf = gguf_path(model, default_cache_root())  # joined from its parts: not timed
    before = memory()["rss"]
    start = time.perf_counter()
    engine = KVBoost.from_pretrained(model, weights=kind)
    seconds = time.perf_counter() - start
    result = sum(t.numel() * t.element_size() for t in engine.model.state_dict().values())
    return {
        "seconds": seconds,
        "gguf_bytes": gguf.stat().st_size,
        "result_bytes": result,
        "start_rss": before,
        **memory(),
    }


def folder(model: str, out: str) -> dict[str, float]:
    """The GGUF converted into the folder ``out`` alone (``kvboost-rag convert``)."""
    from kvboost_rag.core.model.embedded import gguf_path
    from kvboost_rag.core.model.gguf import convert_gguf
    from kvboost_rag.core.model.loading import default_cache_root

    gguf = gguf_path(model, default_cache_root())  # joined from its parts: not timed
    before = memory()["rss"]
    start = time.perf_counter()
    written = convert_gguf(gguf, out)
    seconds = time.perf_counter() - start
    files = sum(f.stat().st_size for f in written.glob("*.safetensors"))
    return {"seconds": seconds, "start_rss": before, "weights_bytes": files, **memory()}


if __name__ == "__main__":
    what, model, *rest = sys.argv[1:]
    found = {
        "first": lambda: first(model, rest[0]),
        "engine": lambda: engine(model, rest[0]),
        "transformers": lambda: transformers_start(model),
        "convert": lambda: convert(model, *rest),
        "folder": lambda: folder(model, rest[0]),
    }[what]()
    print(json.dumps(found))
