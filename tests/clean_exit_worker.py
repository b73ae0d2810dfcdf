"""Run as a separate process by test_clean_exit.py: answer cold RAG prompts and exit.

The prompts' passages are not cached, so the engine encodes them after the answer and
queues their disk writes; the process exits right after printing, with writes queued.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from conftest import make_model, make_tokenizer  # noqa: E402

from kvboost_rag import KVBoost, KVBoostConfig  # noqa: E402
from kvboost_rag.core.reuse import policy  # noqa: E402

policy.SHORT_PASSAGE = 0  # their passages are a few words, reused as in the tests (conftest.py)


def passages(seed: int, prompt: int) -> list[str]:
    return [
        f"Report {seed}.{prompt}.{i}: sector {i} of the depot holds {seed * 31 + i} crates."
        for i in range(3)
    ]


if __name__ == "__main__":
    cache_dir, seed, prompts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    config = KVBoostConfig(cache_dir=cache_dir, fidelity="balanced")
    engine = KVBoost(make_model("llama"), make_tokenizer(), config)
    for p in range(prompts):
        result = engine.generate("Which sector?", passages=passages(seed, p), max_new_tokens=2)
        print(result.passages_missed, repr(result.text))
