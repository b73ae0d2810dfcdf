"""Run by ``bench.decode`` with a Python that has ``llama-cpp-python``: answer the prompts
on stdin (JSON: prompts, max_tokens, gguf, threads) greedily with exactly max_tokens new
tokens, one request at a time, each streamed; print one JSON line of per-request times.
Not imported by the package: it runs in the peer's own environment."""

import json
import sys
import time

from llama_cpp import Llama


def main() -> None:
    job = json.loads(sys.stdin.read())
    threads = int(job["threads"])
    llm = Llama(job["gguf"], n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False)
    llm("warm up", max_tokens=2)
    out = []
    for prompt in job["prompts"]:
        tokens = llm.tokenize(prompt.encode(), add_bos=False, special=True)
        llm.reset()  # no prefix kept from the previous request
        start = time.perf_counter()
        first, count = None, 0
        for _ in llm.generate(tokens, temp=0.0, top_k=1, reset=True):
            count += 1
            first = first or time.perf_counter()
            if count >= job["max_tokens"]:
                break
        end = time.perf_counter()
        out.append(
            {
                "start": start,
                "ttft": (first - start) * 1e3,
                "ttlt": (end - start) * 1e3,
                "ids": None,
                "tokens": count,
            }
        )
    print(json.dumps({"requests": out}))


if __name__ == "__main__":
    main()
