"""Run as a separate process by test_disk.py and test_remote.py: warm passages into a
shared cache_dir and / or Redis."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from conftest import make_model, make_tokenizer  # noqa: E402

from kvboost_rag import KVBoost, KVBoostConfig, warm_corpus  # noqa: E402
from kvboost_rag.core.reuse import policy  # noqa: E402

policy.SHORT_PASSAGE = 0  # their passages are a few words, reused as in the tests (conftest.py)


def corpus(count: int) -> list[str]:
    return [f"Passage number {i} says the code is {i * 7919 % 10000}." for i in range(count)]


if __name__ == "__main__":
    # warm_worker.py CACHE_DIR|- COUNT [REMOTE_URL]
    cache_dir, count = sys.argv[1], int(sys.argv[2])
    remote = sys.argv[3] if len(sys.argv) > 3 else None
    config = KVBoostConfig(cache_dir=None if cache_dir == "-" else cache_dir, remote_url=remote)
    engine = KVBoost(make_model("llama"), make_tokenizer(), config)
    report = warm_corpus(engine, corpus(count), batch_size=1, progress=False)
    print(report.units, report.new, report.cached)
