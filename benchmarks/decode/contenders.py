"""The systems ``bench decode`` measures, each a function from a batch of chat prompts to
per-request times and tokens: the engine (``engine_system``), ``model.generate``
(``generate_system``) and a peer in its own environment (``Peer``)."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import torch

from kvboost_rag import KVBoost
from kvboost_rag.bench.common.baseline import TokenCollector
from kvboost_rag.bench.common.corpus import warm_prefix
from kvboost_rag.core.model import openmp

PEERS = Path(__file__).with_name("peers")


def engine_system(engine: KVBoost, n: int, warm: bool = False):  # type: ignore[no-untyped-def]
    def run(batch: list[list[dict[str, str]]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{} for _ in batch]

        def one(i: int) -> None:
            start = time.perf_counter()
            result = engine.chat(batch[i], max_new_tokens=n)
            out[i] = {
                "start": start,
                "ttft": result.ttft_ms,
                "ttlt": result.total_ms,
                "ids": result.token_ids,
            }

        engine.clear_cache()  # nothing reused but what is warmed below
        if warm:
            engine.warm_passages(_passages(batch), prefix=warm_prefix())
        if len(batch) == 1:  # one user calls from their own thread, as generate runs here
            one(0)
            return out
        # This thread only waits for its callers, as a server's does: it frees the OpenMP
        # pool generate's runs gave it (what the engine's own waiting callers do).
        openmp.release_pool()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(batch))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return out

    return run


def generate_system(base: KVBoost, n: int, lookup: int | None):  # type: ignore[no-untyped-def]
    """``model.generate`` on the very token ids the engine runs (passages are tokenized apart,
    so its answers are comparable token for token), left-padded to a batch."""
    model, tokenizer = base.model, base.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def run(batch: list[list[dict[str, str]]]) -> list[dict[str, Any]]:
        if len(batch) > 1 and lookup is not None:
            return [run([m])[0] for m in batch]  # prompt lookup is batch-1 only in transformers
        start = time.perf_counter()
        rows = [base.tokenize_chat(m) for m in batch]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        collector = TokenCollector()
        extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                do_sample=False,
                streamer=collector if len(batch) == 1 else None,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=pad,
                **extra,
            )
        end = time.perf_counter()
        first = collector.first_token_at if len(batch) == 1 and collector.first_token_at else end
        return [
            {
                "start": start,
                "ttft": (first - start) * 1e3,
                "ttlt": (end - start) * 1e3,
                "ids": out[i, width:].tolist(),
            }
            for i in range(len(batch))
        ]

    return run


def _passages(batch: list[list[dict[str, str]]]) -> list[str]:
    from kvboost_rag.core.prompt.chunker import parse_segments

    return [
        s.text
        for messages in batch
        for m in messages
        for s in parse_segments(m["content"])
        if s.kind == "passage"
    ]


def _plain(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    from kvboost_rag.core.prompt.chunker import parse_segments

    plain = [
        {**m, "content": "".join(s.text for s in parse_segments(m["content"]))} for m in messages
    ]
    return str(tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True))


class Peer:
    """A peer in its own environment, run once per answer length over every batch: its
    runner reads JSON jobs on stdin (each a list of prompts) and prints per-request times
    (its engine's start is not timed)."""

    def __init__(self, python: str, script: str, tokenizer: Any, n: int, model: dict[str, str]):
        self.python, self.script, self.tokenizer, self.n, self.model = (
            python,
            script,
            tokenizer,
            n,
            model,
        )

    def run_all(self, batches: list[list[list[dict[str, str]]]]) -> list[list[dict[str, Any]]]:
        jobs = [[_plain(self.tokenizer, m) for m in batch] for batch in batches]
        payload = {"jobs": jobs, "max_tokens": self.n, **self.model}
        done = subprocess.run(
            [self.python, str(PEERS / self.script)],
            input=json.dumps(payload),
            capture_output=True,
            text=True,
            timeout=3600,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{self.script} failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])["jobs"]  # type: ignore[no-any-return]
