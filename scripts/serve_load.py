"""Concurrent streaming clients against a real ``kvboost-rag serve`` process, beside the same
requests made in process on the same model.

    .venv/bin/python scripts/serve_load.py [--model smollm2-135m-instruct] [--dtype float32]
        [--clients 32] [--tokens 32] [--out OUT.json]

The workload is ``bench load``'s: 3 essay passages a request out of a pool of 24, a
question no other request asks, greedy. Both sides warm the pool first for the requests'
layout (the server through ``POST /v1/kvboost/warm``, in process ``warm_corpus``). Then all
clients start at once, each over its own connection (the ``openai`` package's async client,
streaming): every 8th from the 4th sends a bad request (``max_tokens`` of -1: it must get a
4xx), every 8th from the 6th leaves after its second delta (the server must cancel it and
go on), the rest read their whole answer. In process, the valid requests run as
``stream_chat`` from one thread each, the leavers closing their streams after two deltas.
Each answer read whole is compared with the in-process engine's answer to the same prompt
asked alone (lost: no answer; mixed up: not its own prompt's). Prints a table and writes
JSON: p50 / p99 time to first token and the aggregate tokens/s on each side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

from benchmarks.common.redis_server import free_port
from kvboost_rag import KVBoost, KVBoostConfig, warm_corpus
from kvboost_rag.bench.common.corpus import passages
from kvboost_rag.bench.common.systems import machine
from kvboost_rag.bench.load.run import rag_messages, rag_requests

BAD, LEAVER = 3, 5  # client i % 8: a bad request, a client that leaves mid-stream


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))] if ordered else 0.0


async def client(
    api: Any, i: int, messages: list[dict[str, str]], tokens: int, model: str
) -> dict[str, Any]:
    import openai

    kind = "bad" if i % 8 == BAD else "leaver" if i % 8 == LEAVER else "whole"
    start = time.perf_counter()
    out: dict[str, Any] = {"client": i, "kind": kind}
    try:
        stream = await api.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=-1 if kind == "bad" else tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, deltas, completion = [], 0, None
        async for chunk in stream:
            if chunk.usage is not None:
                completion = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    if not deltas:
                        out["ttft_ms"] = (time.perf_counter() - start) * 1e3
                    deltas += 1
                    text.append(choice.delta.content)
            if kind == "leaver" and deltas >= 2:
                await stream.close()
                break
        out |= {
            "text": "".join(text),
            "tokens": completion,
            "end_ms": (time.perf_counter() - start) * 1e3,
        }
    except openai.APIStatusError as error:
        out |= {"status": error.status_code, "error": error.body}
    except openai.APIError as error:  # the connection failed: a server error
        out |= {"status": 0, "error": str(error)}
    out["start"] = start
    return out


async def over_http(
    url: str, requests: list[Any], tokens: int, model: str
) -> tuple[float, list[dict[str, Any]]]:
    import openai

    clients = [
        openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        for _ in requests
    ]
    start = time.perf_counter()
    results = await asyncio.gather(
        *(client(c, i, m, tokens, model) for i, (c, m) in enumerate(zip(clients, requests)))
    )
    wall = time.perf_counter() - start
    for c in clients:
        await c.close()
    return wall, list(results)


def server(args: argparse.Namespace, texts: list[str]) -> tuple[float, list[dict[str, Any]]]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "kvboost_rag.cli",
        "serve",
        args.model,
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--log-level",
        "warning",
        "--max-queue",
        str(2 * args.clients),
    ]
    process = subprocess.Popen(command, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    root = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                if httpx.get(f"{root}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        prefix = rag_messages(["passage"], "question")
        warmed = httpx.post(
            f"{root}/v1/kvboost/warm", json={"documents": texts, "prefix": prefix}, timeout=1800
        )
        warmed.raise_for_status()
        print("server warmed:", warmed.json(), flush=True)
        return asyncio.run(over_http(f"{root}/v1", args.requests, args.tokens, args.model))
    finally:
        process.terminate()
        process.wait(120)


def in_process(
    engine: KVBoost, requests: list[Any], tokens: int
) -> tuple[float, list[dict[str, Any]]]:
    out: list[dict[str, Any]] = [{} for _ in requests]
    barrier = threading.Barrier(len(requests))

    def one(i: int) -> None:
        kind = "bad" if i % 8 == BAD else "leaver" if i % 8 == LEAVER else "whole"
        out[i] = {"client": i, "kind": kind}
        barrier.wait()
        if kind == "bad":
            return
        start = time.perf_counter()
        stream = engine.stream_chat(requests[i], max_new_tokens=tokens)
        text = []
        for delta in stream:
            if not text:
                out[i]["ttft_ms"] = (time.perf_counter() - start) * 1e3
            text.append(delta)
            if kind == "leaver" and len(text) >= 2:
                stream.close()
                break
        result = stream.result
        out[i] |= {
            "text": "".join(text),
            "tokens": None if result is None else len(result.token_ids),
            "end_ms": (time.perf_counter() - start) * 1e3,
            "start": start,
        }

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, out


def summary(
    name: str, wall: float, runs: list[dict[str, Any]], reference: list[str]
) -> dict[str, Any]:
    whole = [r for r in runs if r["kind"] == "whole"]
    bad = [r for r in runs if r["kind"] == "bad"]
    ttft = [r["ttft_ms"] for r in runs if "ttft_ms" in r]
    tokens = sum(r.get("tokens") or 0 for r in whole)
    lost = sum("text" not in r for r in whole)
    mixed = sum(r.get("text") != reference[r["client"]] for r in whole if "text" in r)
    row = {
        "system": name,
        "clients": len(runs),
        "wall_s": wall,
        "ttft_p50_ms": percentile(ttft, 0.5),
        "ttft_p99_ms": percentile(ttft, 0.99),
        "tokens_per_s": tokens / wall,
        "whole": len(whole),
        "lost": lost,
        "mixed_up": mixed,
        "bad_requests_4xx": sum(400 <= r.get("status", 0) < 500 for r in bad),
        "bad_requests": len(bad),
        "server_errors": sum(
            r.get("status", 200) >= 500 or r.get("status") == 0 for r in runs if r["kind"] != "bad"
        ),
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", default="serve-load.json")
    args = parser.parse_args()
    base = KVBoost.from_pretrained(args.model, dtype=args.dtype)
    texts = passages(base.tokenizer, 200, 24)
    args.requests = rag_requests(texts, 3, args.clients, 0)
    reference_engine = KVBoost(base.model, base.tokenizer, KVBoostConfig(max_batch_size=1))
    warm_corpus(
        reference_engine, texts, prefix=rag_messages(["passage"], "question"), progress=False
    )
    reference = [reference_engine.chat(m, max_new_tokens=args.tokens).text for m in args.requests]
    print("references done", flush=True)
    engine = KVBoost(base.model, base.tokenizer)
    warm_corpus(engine, texts, prefix=rag_messages(["passage"], "question"), progress=False)
    local = in_process(engine, args.requests, args.tokens)
    over = server(args, texts)
    rows = [
        summary("in process (stream_chat, a thread each)", *local, reference),
        summary("kvboost-rag serve (openai AsyncOpenAI, streaming)", *over, reference),
    ]
    for row in rows:
        print(json.dumps(row), flush=True)
    keys = (
        "ttft_p50_ms",
        "ttft_p99_ms",
        "tokens_per_s",
        "whole",
        "lost",
        "mixed_up",
        "bad_requests_4xx",
        "server_errors",
    )
    print(f"{'system':52} " + " ".join(f"{k:>16}" for k in keys))
    for row in rows:
        print(
            f"{row['system']:52} "
            + " ".join(
                f"{row[k]:16.1f}" if isinstance(row[k], float) else f"{row[k]:>16}" for k in keys
            )
        )
    report = {
        "args": {k: v for k, v in vars(args).items() if k != "requests"},
        "machine": machine(base),
        "rows": rows,
        "server_runs": over[1],
        "in_process_runs": local[1],
        "reference": reference,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
