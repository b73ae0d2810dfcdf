"""Warm a corpus into a cache_dir once, then answer from it in a second process.

The first process encodes each essay's passage KV and writes it to disk (warm_corpus).
The second process starts with an empty memory cache, opens the same cache_dir and
reads the passages' KV from disk instead of computing it. The essays are the ones
``scripts/setup.sh`` installs (``kvboost_rag.essays`` finds them).
"""

import subprocess
import sys
import tempfile

from kvboost_rag import KVBoost, KVBoostConfig, format_passages, warm_corpus
from kvboost_rag.essays import essay_texts

# The served prompts: this head, the essays as passages, then the question. The corpus is
# warmed for the head, so each passage's KV is encoded after the exact text before it.
HEAD = "Read these essays.\n\n"
QUESTION = "Question: what is the first essay about? Answer in one sentence.\nAnswer:"


def essays(count: int = 3, chars: int = 1500) -> list[str]:
    return [" ".join(text.split())[:chars] for text in essay_texts()[:count]]


def serve(cache_dir: str) -> None:
    engine = KVBoost.from_pretrained(config=KVBoostConfig(cache_dir=cache_dir))
    result = engine.generate(HEAD + format_passages(essays()) + QUESTION, max_new_tokens=24)
    print(f"second process: {result.text.strip()!r}")
    print(
        f"  ttft {result.ttft_ms:.0f} ms, passages from disk {result.passages_hit} "
        f"({result.passages_foreign} foreign), encoded {result.passages_missed}, "
        f"reused {result.reused_tokens}/{result.prompt_tokens}"
    )


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    serve(sys.argv[2])
elif __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="kvboost-cache-") as cache_dir:
        engine = KVBoost.from_pretrained(config=KVBoostConfig(cache_dir=cache_dir))
        report = warm_corpus(engine, essays(), prefix=HEAD, progress=False)
        print(f"warmed {report.units} passages ({report.tokens} tokens) to disk")
        served = subprocess.run(
            [sys.executable, __file__, "--serve", cache_dir],
            capture_output=True,
            text=True,
            check=True,
        )
        print(served.stdout, end="")
