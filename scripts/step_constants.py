"""The measurements behind the decoding loop's tuned constants, on one model, in one run.

    .venv/bin/python scripts/step_constants.py MODEL DTYPE OUT.json [--parts a,b,...]

Every part times the engine's own forwards (``Runner.run_rows`` on its slot cache, the
linear ways ``linears.measure`` picks), calls interleaved so the machine's drift is shared;
it prints a table and writes JSON. Parts, and the constant each one sets:

- ``draft``: one decoding step of R rows over ``KEYS`` cached keys feeding q tokens a row
  (R = 1: q up to 17; R = 4, 8: q = 1-3). A lone row's draft is worth its width while q
  tokens cost about one (``config.DEFAULT_DRAFT_TOKENS``); a batch's 1-token draft pays
  above a hit rate of t(R, 2) / t(R, 1) - 1 (``drafting.DRAFT_COST_PER_ROW`` asks R times
  it) and a 2-token one where t(R, 3) is no dearer than the tokens it keeps
  (``drafting.BATCH_DRAFT_TOKENS``).
- ``fill``: a prompt of ``PROMPT`` tokens filled alone, two filled in one forward (equal
  lengths, and padded to the longer), and one cut in chunks (``batch.FILL_ROWS``,
  ``batch.FILL_TOKENS``).
- ``prefix``: a prompt of ``PROMPT`` tokens filled over a cached prefix of P of them
  against the whole prompt filled plainly, per token fed (``policy.MASKED_PREFILL_COST``:
  a cached prefix pays where its tokens saved outweigh the dearer rest).
- ``head``: the lm_head at 1, 8 and 9 rows through ``F.linear`` and packed for oneDNN with
  several expected row counts (``packed.PACK_ROWS``: the hint, and the rows the warm-up's
  check times).
- ``linears``: ``linears.measure`` three times as the warm-up runs it and once with three
  times the repeats over four times the streamed bytes (``linears.REPEATS``,
  ``linears.STREAMED_BYTES``): the ways each picks per row count.
- ``compiled``: the compiled one-row step against the eager one at 512, 900 and 2048 keys
  (``compiled.CHECK_KEYS``: where the warm-up's check decides).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kvboost_rag import KVBoost
from kvboost_rag.bench.common.systems import machine
from kvboost_rag.core.generation.batch import Batch
from kvboost_rag.core.generation.compiled import CompiledStep
from kvboost_rag.core.generation.handle import ModelHandle
from kvboost_rag.core.model import linears
from kvboost_rag.core.model.torch_compat import packed_linear, reorder_linear_weight

KEYS = 900  # cached keys a decoding row holds: a RAG prompt of three passages
PROMPT = 830  # a prompt's tokens, filled
REPEATS = 7
PARTS = ("draft", "fill", "prefix", "head", "linears", "compiled")


def interleaved(calls: dict[str, Callable[[], object]], repeats: int = REPEATS) -> dict[str, float]:
    """Median ms of each call, the calls taken in turn (reversed every other pass)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        fn()  # first-use costs
    for r in range(repeats):
        order = list(calls.items()) if r % 2 == 0 else list(calls.items())[::-1]
        for name, fn in order:
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def ids(count: int, vocab: int, seed: int) -> list[int]:
    return [(7919 * (i + seed) + 13) % vocab for i in range(count)]


def step(runner: Any, rows: int, width: int, vocab: int) -> Callable[[], object]:
    """A decoding step of ``rows`` rows fed ``width`` tokens each at their end (``KEYS``)."""
    everyone = list(range(rows))
    tokens = [ids(width, vocab, 5 + r) for r in everyone]
    positions = [range(KEYS, KEYS + width)] * rows

    def run() -> object:
        for r in everyone:
            runner.slots.lengths[r] = KEYS
        return runner.run_rows(everyone, tokens, positions, keep=width)

    return run


def draft(runner: Any, vocab: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rows, widths in ((1, (1, 2, 3, 5, 9, 13, 17)), (4, (1, 2, 3)), (8, (1, 2, 3))):
        calls = {f"{rows}x{w}": step(runner, rows, w, vocab) for w in widths}
        ms = interleaved(calls)
        base = ms[f"{rows}x1"]
        out[str(rows)] = {
            w: {"ms": ms[f"{rows}x{w}"], "x_one": ms[f"{rows}x{w}"] / base} for w in widths
        }
        for w in widths:
            print(
                f"draft  {rows} rows x {w:2} tokens: {ms[f'{rows}x{w}']:8.1f} ms  "
                f"({ms[f'{rows}x{w}'] / base:.2f}x one token)",
                flush=True,
            )
        if rows > 1:
            even = ms[f"{rows}x2"] / base - 1
            print(
                f"draft  {rows} rows: a 1-token draft pays above a {even:.0%} hit rate "
                f"({even / rows:.3f} a row)",
                flush=True,
            )
    return out


def fill(runner: Any, vocab: int) -> dict[str, Any]:
    """Rows 0-1 filled from position 0 each call (their lengths reset first)."""
    prompt, other = ids(PROMPT, vocab, 1), ids(PROMPT, vocab, 2)
    short = other[: PROMPT * 3 // 4]

    def filled(
        rows: list[int], feeds: list[list[int]], chunk: int | None = None
    ) -> Callable[[], object]:
        def run() -> object:
            for r in rows:
                runner.slots.lengths[r] = 0
            if chunk is None:
                return runner.run_rows(rows, feeds, [range(len(f)) for f in feeds])
            for start in range(0, len(feeds[0]), chunk):
                part = feeds[0][start : start + chunk]
                runner.run_rows(rows, [part], [range(start, start + len(part))])
            return None

        return run

    calls = {
        "one row": filled([0], [prompt]),
        "two rows, equal": filled([0, 1], [prompt, other]),
        "two rows, padded": filled([0, 1], [prompt, short]),
        "one row, chunks of 512": filled([0], [prompt], 512),
        "one row, chunks of 256": filled([0], [prompt], 256),
    }
    ms = interleaved(calls, repeats=3)
    tokens = {"two rows, equal": 2 * PROMPT, "two rows, padded": PROMPT + len(short)}
    out = {}
    for name, value in ms.items():
        per = value / tokens.get(name, PROMPT)
        out[name] = {"ms": value, "ms_per_token": per}
        print(f"fill   {name:24}: {value:8.0f} ms, {per:.2f} ms a prompt token", flush=True)
    return out


def prefix(runner: Any, vocab: int) -> dict[str, Any]:
    """Row 0 holds the prompt's first P positions (filled before) when its rest is fed."""
    prompt = ids(PROMPT, vocab, 1)
    runner.slots.lengths[0] = 0
    runner.run_rows([0], [prompt], [range(PROMPT)])

    def fed(past: int) -> Callable[[], object]:
        def run() -> object:
            runner.slots.lengths[0] = past
            return runner.run_rows([0], [prompt[past:]], [range(past, PROMPT)])

        return run

    pasts = (0, 100, 200, PROMPT // 2)
    ms = interleaved({str(p): fed(p) for p in pasts}, repeats=5)
    plain = ms["0"] / PROMPT
    out = {}
    for past in pasts:
        per = ms[str(past)] / (PROMPT - past)
        out[str(past)] = {"ms": ms[str(past)], "ms_per_token": per, "x_plain": per / plain}
        print(
            f"prefix {past:3} cached + {PROMPT - past} fed: {ms[str(past)]:6.0f} ms, "
            f"{per:.2f} ms a token ({per / plain:.2f}x plain)",
            flush=True,
        )
    return out


def head(model: Any) -> dict[str, Any]:
    weight = model.get_output_embeddings().weight.detach()
    packs = {hint: reorder_linear_weight(weight, hint) for hint in (1, 8, 16)}
    out: dict[str, Any] = {}
    for rows in (1, 8, 9):
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
        calls: dict[str, Callable[[], object]] = {"F.linear": lambda x=x: F.linear(x, weight)}
        for hint, packed in packs.items():
            calls[f"packed, hint {hint}"] = lambda x=x, p=packed: packed_linear(x, p, None)
        ms = interleaved(calls, repeats=9)
        out[str(rows)] = ms
        cells = ", ".join(f"{k} {v:.1f}" for k, v in ms.items())
        print(f"head   {rows} rows: {cells} ms", flush=True)
    return out


def measured_ways(model: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"default": []}
    for _ in range(3):
        start = time.perf_counter()
        ways = linears.measure(model, packed=True)
        took = time.perf_counter() - start
        out["default"].append({"fastest": ways.fastest, "seconds": took})
        print(f"ways   default ({took:.0f} s): {ways.fastest}", flush=True)
    repeats, streamed = linears.REPEATS, linears.STREAMED_BYTES
    linears.REPEATS, linears.STREAMED_BYTES = 3 * repeats, 4 * streamed
    try:
        start = time.perf_counter()
        ways = linears.measure(model, packed=True)
        took = time.perf_counter() - start
    finally:
        linears.REPEATS, linears.STREAMED_BYTES = repeats, streamed
    out["thorough"] = {"fastest": ways.fastest, "seconds": took}
    print(f"ways   thorough ({took:.0f} s): {ways.fastest}", flush=True)
    return out


def compiled(runner: Any, vocab: int) -> dict[str, Any]:
    keys = (512, 900, 2048)
    runner.slots.lengths[0] = 0
    runner.run_rows([0], [ids(keys[-1], vocab, 3)], [range(keys[-1])])
    step_ = CompiledStep(runner.model, runner.support, runner.slots)
    token = vocab // 2

    def eager(at: int) -> Callable[[], object]:
        def run() -> object:
            runner.slots.lengths[0] = at
            return runner.run_rows([0], [[token]], [[at]])

        return run

    import torch._inductor.config as inductor

    step_._forward = torch.compile(runner.model.forward, dynamic=None)
    start = time.perf_counter()
    with inductor.patch(freezing=True, cpp_wrapper=True):
        step_._call(token, keys[0], mark=True)
    took = time.perf_counter() - start
    print(f"compiled: compiled in {took:.0f} s", flush=True)
    out: dict[str, Any] = {"compile_s": took}
    for at in keys:
        ms = interleaved({"compiled": lambda at=at: step_._call(token, at), "eager": eager(at)})
        out[str(at)] = ms
        print(
            f"compiled over {at:4} keys: compiled {ms['compiled']:.1f}, eager {ms['eager']:.1f} ms",
            flush=True,
        )
    return out


def main() -> None:
    name, dtype, path = sys.argv[1:4]
    parts = sys.argv[5].split(",") if len(sys.argv) > 5 and sys.argv[4] == "--parts" else PARTS
    base = KVBoost.from_pretrained(name, dtype=dtype)
    model = base.model
    handle = ModelHandle.of(model)
    runner = Batch(handle.engine_model, handle.support).runner
    runner.warm_up(0, None, packed_linears=True)
    vocab = int(model.config.vocab_size)
    report: dict[str, Any] = {
        "model": name,
        "dtype": dtype,
        "machine": machine(base),
        "keys": KEYS,
        "prompt": PROMPT,
        "ways_at_warm_up": runner.ways.fastest,
    }
    with torch.inference_mode():
        runner.slots.reserve(8, max(KEYS, 2048) + 20)
        if "draft" in parts:
            for r in range(8):
                runner.slots.lengths[r] = 0
                runner.run_rows([r], [ids(KEYS, vocab, 10 + r)], [range(KEYS)])
            report["draft"] = draft(runner, vocab)
        if "fill" in parts:
            report["fill"] = fill(runner, vocab)
        if "prefix" in parts:
            report["prefix"] = prefix(runner, vocab)
        if "head" in parts:
            report["head"] = head(handle.engine_model)
        if "linears" in parts:
            report["linears"] = measured_ways(handle.engine_model)
        if "compiled" in parts:
            report["compiled"] = compiled(runner, vocab)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print("wrote", path)


if __name__ == "__main__":
    main()
