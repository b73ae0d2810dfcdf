"""One user at a time: time to first and to last token against ``model.generate``.

    python -m kvboost_rag.bench.latency [--dtype bfloat16] [--lengths 1,12,64,256]
        [--requests 4] [--out DIR] [--quick]

RAG chat prompts of ~880 tokens (a system message, four essay passages holding one
invented fact each, a question about one of them, at a varying position) are answered
greedily with exactly N new tokens (``min_new_tokens`` in the model's generation config,
which every system below reads) by, on one model object, one request at a time:

- ``generate``: plain ``model.generate`` on the prompt's tokens (full prefill);
- ``prefix cache``: ``generate`` over a deep copy of the longest cached prefix among the
  last 64 prompts' ``DynamicCache``s (transformers' documented prefix-reuse recipe);
- ``exact`` / ``balanced`` / ``fast``: ``KVBoost.chat`` at each fidelity.

Two scenarios: *cold* (every cache emptied before each request: nothing is reused) and
*warm* (the passage pool warmed with ``warm_corpus`` for the prompts' layout; each request
draws passages from it in a new order, after the previous requests, so exact prefixes
recur too). Within a request the systems run back to back in
an order that rotates; what an engine defers after an answer (passage encodes) is waited
for between requests and reported as ``background_ms``, so no system's timing includes
another's work. TTFT is the call to the first token, tokenization included; TTLT the call
to the last; ms/token the time after the first token over the tokens after it. The floor
is one forward of only the prompt's tokens after its last passage over a ready cache.
Prints the table and writes ``latency-<dtype>[-<weights>].json`` / ``.txt`` / ``.png``.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import time
from typing import Any

import torch

from kvboost_rag import KVBoost, KVBoostConfig, warm_corpus
from kvboost_rag.bench.common.baseline import TokenCollector
from kvboost_rag.bench.common.corpus import (
    FactPassage,
    fact_passages,
    messages_for,
    passages,
    warm_prefix,
)
from kvboost_rag.bench.common.runs import parse_common, run_and_write
from kvboost_rag.bench.common.systems import machine
from kvboost_rag.bench.common.transcript import note
from kvboost_rag.bench.latency.report import draw, summarize, table
from kvboost_rag.cli.arguments import (
    ArgumentParser,
    dtype_name,
    positive,
    positive_list,
)
from kvboost_rag.core.choices import Fidelity

FIDELITIES: tuple[Fidelity, ...] = ("exact", "balanced", "fast")
QUICK = {"lengths": [1, 4], "requests": 1, "pool": 8, "chunk_tokens": 60}
K = 4  # passages per prompt


class PrefixCacheHF:
    """``generate`` reusing the longest cached prefix among the last ``keep`` prompts."""

    def __init__(self, model: Any, keep: int = 64) -> None:
        self.model = model
        self.keep = keep
        self.prompts: list[tuple[list[int], Any]] = []

    def clear(self) -> None:
        self.prompts.clear()

    def run(self, tokens: list[int], n: int, collector: TokenCollector) -> int:
        """Generate ``n`` tokens after ``tokens``; returns how many prompt tokens it reused."""
        best, cache = 0, None
        for seen, stored in self.prompts:
            shared = _common(seen, tokens)
            if shared > best:
                best, cache = shared, stored
        best = min(best, len(tokens) - 1)  # generate needs at least one new token
        past = None
        if cache is not None and best > 0:
            past = copy.deepcopy(cache)
            past.crop(best - past.get_seq_length())  # transformers 5 crops by a negative count
        ids = torch.tensor([tokens], device=self.model.device)
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=past,
            max_new_tokens=n,
            do_sample=False,
            streamer=collector,
            return_dict_in_generate=True,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        kept = out.past_key_values
        kept.crop(len(tokens) - kept.get_seq_length())
        self.prompts = [*self.prompts, (tokens, kept)][-self.keep :]
        return best if past is not None else 0


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def hf_run(model: Any, tokenize: Any, n: int, prefix: PrefixCacheHF | None) -> dict[str, Any]:
    start = time.perf_counter()
    tokens = tokenize()
    collector = TokenCollector()
    with torch.inference_mode():
        if prefix is None:
            ids = torch.tensor([tokens], device=model.device)
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                do_sample=False,
                streamer=collector,
                temperature=None,
                top_p=None,
                top_k=None,
            )
            reused = 0
        else:
            reused = prefix.run(tokens, n, collector)
    end = collector.last_token_at or time.perf_counter()
    first = collector.first_token_at or end
    return {
        "ttft_ms": (first - start) * 1e3,
        "ttlt_ms": (end - start) * 1e3,
        "token_ids": collector.token_ids,
        "reused": reused,
        "prompt": len(tokens),
    }


def engine_run(engine: KVBoost, messages: list[dict[str, str]], n: int) -> dict[str, Any]:
    result = engine.chat(messages, max_new_tokens=n)
    started = time.perf_counter()
    engine.flush()  # passages deferred after the answer: off every request's clock
    return {
        "ttft_ms": result.ttft_ms,
        "ttlt_ms": result.total_ms,
        "token_ids": result.token_ids,
        "reused": result.reused_tokens,
        "prompt": result.prompt_tokens,
        "background_ms": (time.perf_counter() - started) * 1e3,
        "timings": result.timings.as_dict(),
    }


def floor_ms(model: Any, tokens: list[int], tail: int) -> float:
    """One forward of the last ``tail`` tokens over a ready cache of the rest (median of 3)."""
    from transformers import DynamicCache

    with torch.inference_mode():
        head = DynamicCache()
        model(input_ids=torch.tensor([tokens[:-tail]], device=model.device), cache=head)
        times = []
        for _ in range(3):
            cache = copy.deepcopy(head)
            start = time.perf_counter()
            ids = torch.tensor([tokens[-tail:]], device=model.device)
            model(input_ids=ids, cache=cache, logits_to_keep=1)
            times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def requests(pool: list[FactPassage], count: int, rng: random.Random) -> list[list[FactPassage]]:
    """``count`` prompts of ``K`` passages; the one asked about at position i % K."""
    out = []
    for i in range(count):
        docs = rng.sample(pool, K)
        out.append(docs[1 : 1 + i % K] + docs[:1] + docs[1 + i % K :])
    return out


def run_request(
    systems: dict[str, Any], docs: list[FactPassage], asked: FactPassage, n: int, turn: int
) -> dict[str, Any]:
    messages = messages_for(docs, asked.question)
    names = list(systems)
    order = names[turn % len(names) :] + names[: turn % len(names)]
    return {name: systems[name](messages, n) for name in order}


def build(base: KVBoost) -> tuple[dict[str, KVBoost], PrefixCacheHF]:
    engines: dict[str, KVBoost] = {
        f: KVBoost(base.model, base.tokenizer, KVBoostConfig(fidelity=f)) for f in FIDELITIES
    }
    return engines, PrefixCacheHF(base.model)


def scenario(
    name: str, base: KVBoost, pool: list[FactPassage], args: argparse.Namespace
) -> list[dict[str, Any]]:
    engines, prefix = build(base)
    model, tokenize_chat = base.model, base.tokenize_chat
    if name == "warm":
        for fidelity in ("balanced", "fast"):
            warm_corpus(
                engines[fidelity], [p.text for p in pool], prefix=warm_prefix(), progress=False
            )
    systems: dict[str, Any] = {
        "generate": lambda m, n: hf_run(model, lambda: tokenize_chat(m), n, None),
        "prefix cache": lambda m, n: hf_run(model, lambda: tokenize_chat(m), n, prefix),
        **{f: (lambda m, n, e=e: engine_run(e, m, n)) for f, e in engines.items()},
    }
    rng = random.Random(args.seed)
    rows = []
    for length in args.lengths:
        model.generation_config.min_new_tokens = length
        for turn, docs in enumerate(requests(pool, args.requests, rng)):
            if name == "cold":
                for engine in engines.values():
                    engine.clear_cache()
                prefix.clear()
            asked = docs[turn % K]
            note(f"{name} N={length} request {turn + 1}/{args.requests}")
            runs = run_request(systems, docs, asked, length, turn)
            tokens = tokenize_chat(messages_for(docs, asked.question))
            tail = len(tokens) - _after_last_passage(base, docs, asked)
            rows.append(
                {
                    "scenario": name,
                    "length": length,
                    "turn": turn,
                    "answer": asked.answer,
                    "floor_ms": floor_ms(model, tokens, tail),
                    "floor_tokens": tail,
                    "runs": runs,
                }
            )
    model.generation_config.min_new_tokens = None
    return rows


def _after_last_passage(base: KVBoost, docs: list[FactPassage], asked: FactPassage) -> int:
    """Tokens up to the end of the prompt's last passage."""
    return base.inspect.prompt(messages_for(docs, asked.question)).passages[-1].end


def record(args: argparse.Namespace) -> dict[str, Any]:
    start, load = time.perf_counter(), os.getloadavg()
    base = KVBoost.from_pretrained(args.model, dtype=args.dtype, weights=args.weights)
    pool = fact_passages(passages(base.tokenizer, args.chunk_tokens, args.pool), args.seed)
    rows = scenario("warm", base, pool, args)
    rows += scenario("cold", base, pool, args)
    return {
        "command": "kvboost-rag bench latency " + " ".join(args.argv),
        "model": args.model,
        "weights": args.weights or "checkpoint",
        "quick": args.quick,
        "machine": machine(base),
        "settings": {k: getattr(args, k) for k in ("lengths", "requests", "pool", "chunk_tokens")},
        "rows": rows,
        "summary": summarize(rows),
        "load_average": {"start": load, "end": os.getloadavg()},
        "seconds": time.perf_counter() - start,
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog="kvboost-rag bench latency", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--dtype", type=dtype_name, default=None, help="default: the engine's (bf16 where fast)"
    )
    parser.add_argument(
        "--lengths", type=positive_list, default=[1, 12, 64, 256], help="new tokens per answer"
    )
    parser.add_argument("--requests", type=positive, default=4, help="requests per scenario/length")
    parser.add_argument("--pool", type=positive, default=24, help="passages in the warm pool")
    parser.add_argument("--chunk-tokens", type=positive, default=200, help="tokens per passage")
    return parse_common(parser, argv, QUICK)


def main(argv: list[str] | None = None) -> None:
    run_and_write("latency", parse(argv), record, table, draw)


if __name__ == "__main__":
    main()
