"""Constrained decoding: how often the embedded model's answers are valid with and without
it, and what each library costs per token, side by side in one run.

    python -m benchmarks.constrained [--dtype float32] [--repeats 5] [--out DIR]

1. Libraries (llguidance, outlines-core, lm-format-enforcer; see ``grammars``): for a
   tool-call target and a JSON-answer target, plain ``model.generate`` greedy under each
   library's logits processor, each run followed by unconstrained ``generate`` of the same
   prompt forced to the same number of tokens. Reported: wall ms/token of both and their
   difference (median over repeats), the processor's own ms per call (in generate, and
   replayed over the same tokens without the model), one-time costs (per tokenizer, per
   schema, per request) and whether the output parsed and validated. Runs first: the
   engine keeps llguidance's tokenizer view for the process once a constrained request
   built it, and the llguidance setup time would then read as zero.
2. Engine: every task of ``constrained_tasks`` through ``engine.chat`` with
   ``constrain=False`` and ``constrain=True`` (interleaved, cache cleared before each call):
   valid rate, and ms per output token end to end.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.constrained import report
from benchmarks.constrained.grammars import (
    LIBRARIES,
    Library,
    Target,
    TimedProcessor,
    json_target,
    tool_target,
)
from benchmarks.constrained.tasks import (
    JSON_TASKS,
    TOOL_TASKS,
    TOOLS,
    Task,
    call_errors,
    json_errors,
)
from kvboost_rag import KVBoost
from kvboost_rag.bench.common.metrics import median
from kvboost_rag.cli.arguments import ArgumentParser, dtype_name, positive
from kvboost_rag.core.generation.handle import eos_ids
from kvboost_rag.core.tools.structure import Structure, json_schema

# Target -> the request whose prompt it is decoded after.
TOOL_TARGET = tool_target("tool call (4 tools)", [TOOLS[n] for n in TOOL_TASKS[16].tools])
JSON_TARGET = json_target("JSON answer (nested)", JSON_TASKS[6].schema)
PROMPTS = {TOOL_TARGET.name: TOOL_TASKS[16].messages, JSON_TARGET.name: JSON_TASKS[6].messages}


def elapsed_ms(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


def errors_of(structure: Structure, text: str) -> list[str]:
    """Why ``text`` is not a valid answer to a request of this ``structure``."""
    if structure.response_format is not None:
        return json_errors(text, json_schema(structure.response_format))
    parsed = structure.parse(text)
    return call_errors(parsed.calls, parsed.invalid, structure.tools, structure.tool_choice)


def generate(
    engine: KVBoost, ids: torch.Tensor, processor: Any, tokens: int
) -> tuple[list[int], float]:
    """Greedy ``model.generate``: (new token ids, wall ms). Without a processor it is forced
    to exactly ``tokens`` tokens."""
    forced = {} if processor else {"min_new_tokens": tokens}
    start = time.perf_counter()
    with torch.inference_mode():
        out = engine.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            do_sample=False,
            logits_processor=[processor] if processor else None,
            temperature=None,
            top_p=None,
            top_k=None,
            **forced,
        )
    return out[0, ids.shape[1] :].tolist(), elapsed_ms(start)


def setup(engine: KVBoost, library: Library, targets: list[Target]) -> dict[str, Any]:
    """Prepare ``library`` and compile every target: timings, or the error text. A target's
    compile time includes building its first processor (which is where some libraries
    reject a schema); that per-request part is also timed alone in ``run_once``."""
    row: dict[str, Any] = {"targets": {}, "notes": library.notes}
    start = time.perf_counter()
    library.prepare(engine.tokenizer, sorted(eos_ids(engine.model)))
    row["prepare_ms"] = elapsed_ms(start)
    for target in targets:
        start = time.perf_counter()
        try:
            factory = library.compile(target)
            factory()
        except Exception as error:  # a library failing on a schema is a result to report
            row["targets"][target.name] = {"error": f"{type(error).__name__}: {error}"}
            continue
        row["targets"][target.name] = {"compile_ms": elapsed_ms(start), "factory": factory}
    return row


def run_once(engine: KVBoost, target: Target, cell: dict[str, Any], max_new: int) -> None:
    """One constrained generate and its matched unconstrained one, appended to ``cell``."""
    ids = torch.tensor([engine.tokenize_chat(PROMPTS[target.name], tools=target.structure.tools)])
    start = time.perf_counter()
    processor = TimedProcessor(cell["factory"]())
    cell["request_ms"].append(elapsed_ms(start))
    tokens, ms = generate(engine, ids, processor, max_new)
    _, base_ms = generate(engine, ids, None, len(tokens))
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    cell["runs"].append(
        {
            "tokens": len(tokens),
            "ms": ms,
            "base_ms": base_ms,
            "first_call_ms": processor.calls_ms[0],
            "call_ms": median(processor.calls_ms[1:]),
            "finished": tokens[-1] in eos_ids(engine.model),
            "errors": errors_of(target.structure, text),
            "text": text,
            "replay_ms": replay(cell["factory"](), ids, tokens, engine.model.config.vocab_size),
        }
    )


def replay(processor: Any, ids: torch.Tensor, tokens: list[int], vocab: int) -> float:
    """Median ms per call of a fresh processor fed ``tokens`` without the model (the
    first call, which may build lazy state, left out). On one torch thread: the masking's
    small tensor ops otherwise wait on a thread pool that a busy machine deschedules, and
    that wait, not the library, dominates."""
    scores = torch.zeros(1, vocab)
    times = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for k in range(len(tokens)):
            seen = torch.cat([ids, torch.tensor([tokens[:k]], dtype=ids.dtype)], dim=1)
            start = time.perf_counter()
            processor(seen, scores)
            times.append(elapsed_ms(start))
    finally:
        torch.set_num_threads(threads)
    return median(times[1:])


def measure_libraries(engine: KVBoost, repeats: int, max_new: int) -> dict[str, Any]:
    targets = [TOOL_TARGET, JSON_TARGET]
    rows = {name: setup(engine, make(), targets) for name, make in LIBRARIES.items()}
    for row in rows.values():
        for cell in row["targets"].values():
            cell.update(request_ms=[], runs=[])
    for _ in range(repeats):  # interleaved, so every library sees the same machine state
        for target in targets:
            for row in rows.values():
                cell = row["targets"][target.name]
                if "factory" in cell:
                    run_once(engine, target, cell, max_new)
    return {name: report.library_summary(row) for name, row in rows.items()}


def measure_engine(engine: KVBoost, max_new: int, limit: int | None) -> dict[str, Any]:
    """Every task with and without constraint; per task set and mode, the raw records."""
    sets: dict[str, Sequence[Task]] = {
        "tool calls": TOOL_TASKS[:limit],
        "JSON answers": JSON_TASKS[:limit],
    }
    records: dict[str, dict[str, list]] = {s: {"off": [], "on": []} for s in sets}
    for name, tasks in sets.items():
        for task in tasks:
            for mode in ("off", "on"):
                records[name][mode].append(chat_once(engine, task, mode == "on", max_new))
    return records


def chat_once(engine: KVBoost, task: Task, constrain: bool, max_new: int) -> dict[str, Any]:
    engine.clear_cache()  # both modes prefill the whole prompt
    result = engine.chat(task.messages, constrain=constrain, max_new_tokens=max_new, **task.request)
    answer = (result.text, result.tool_calls, result.invalid_tool_calls)
    errors = task.errors(*answer)
    return {
        "question": task.question,
        "valid": not errors,
        "valid_unfenced": not task.errors(*answer, unfence=True),
        "errors": errors,
        "text": result.text,
        "calls": [{"name": c.name, "arguments": c.arguments} for c in result.tool_calls],
        "tokens": result.completion_tokens,
        "ttft_ms": result.ttft_ms,
        "total_ms": result.total_ms,
        "decode_ms": result.timings.decode_ms,
    }


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        prog="python -m benchmarks.constrained", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", type=dtype_name, help="float32 or bfloat16")
    parser.add_argument("--repeats", type=positive, default=5, help="library runs per target")
    parser.add_argument("--max-new-tokens", type=positive, default=64)
    parser.add_argument("--limit", type=positive, default=None, help="first N tasks of each set")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args(argv)
    start, load = time.perf_counter(), report.load_average()
    engine = KVBoost.from_pretrained(args.model, dtype=args.dtype)
    libraries = measure_libraries(engine, args.repeats, args.max_new_tokens)
    engine_records = measure_engine(engine, args.max_new_tokens, args.limit)
    result = {
        **report.machine(engine, load),
        "model": args.model,
        "repeats": args.repeats,
        "max_new_tokens": args.max_new_tokens,
        "libraries": libraries,
        "engine": report.engine_summary(engine_records),
        "wall_s": round(time.perf_counter() - start, 1),
    }
    report.write(args.out, result)


if __name__ == "__main__":
    main()
