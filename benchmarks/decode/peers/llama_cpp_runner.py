"""Run by ``bench.decode`` with a Python that has ``llama-cpp-python``: answer the jobs on
stdin (JSON: jobs, each a list of prompts; max_tokens, gguf, threads) greedily with exactly
max_tokens new tokens, one request at a time (the Python binding serves one sequence), each
streamed; print one JSON line of per-request times, job by job.
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
    print(
        json.dumps({"jobs": [answer(llm, prompts, job["max_tokens"]) for prompts in job["jobs"]]})
    )


def answer(llm: Llama, prompts: list[str], max_tokens: int) -> list[dict]:
    out = []
    for prompt in prompts:
        tokens = llm.tokenize(prompt.encode(), add_bos=False, special=True)
        llm.reset()  # no prefix kept from the previous request
        start = time.perf_counter()
        first, count = None, 0
        for _ in llm.generate(tokens, temp=0.0, top_k=1, reset=True):
            count += 1
            first = first or time.perf_counter()
            if count >= max_tokens:
                break
        end = time.perf_counter()
        ttft, ttlt = ((first or end) - start) * 1e3, (end - start) * 1e3
        out.append({"start": start, "ttft": ttft, "ttlt": ttlt, "ids": None, "tokens": count})
    return out


if __name__ == "__main__":
    main()
