"""One workload of the fidelity front, measured: every option beside a full prefill of the
same tokens, interleaved query by query, and each option's line of numbers."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from benchmarks.front import tasks
from kvboost_rag import GenerationResult, KVBoost
from kvboost_rag.bench.common import systems
from kvboost_rag.bench.common.baseline import BaselineRun, full_prefill
from kvboost_rag.bench.common.metrics import Row, kl_div, median, summary


@dataclass
class FrontRow(Row):
    """``Row`` plus where each request's passages came from."""

    foreign: list[int] = field(default_factory=list)  # reused from another prefix's variant
    missed: list[int] = field(default_factory=list)  # not cached
    where: list[str] = field(default_factory=list)  # the answer's passage: first/middle/last
    computed: list[float] = field(default_factory=list)  # share of the prompt computed
    probe_ms: list[float] = field(default_factory=list)  # choosing what to repair
    ttlt: list[float] = field(default_factory=list)  # ms from the call to the last token
    answers: list[str] = field(default_factory=list)  # each whole answer, as text


def ask(engine: KVBoost, prompt: tasks.Prompt, new_tokens: int) -> GenerationResult:
    if isinstance(prompt, str):
        return engine.generate(prompt, max_new_tokens=new_tokens)
    return engine.chat(prompt, max_new_tokens=new_tokens)


def tokens(engine: KVBoost, prompt: tasks.Prompt) -> list[int]:
    return engine.tokenize(prompt) if isinstance(prompt, str) else engine.tokenize_chat(prompt)


def reference(
    base: KVBoost, prompt: tasks.Prompt, new_tokens: int
) -> tuple[BaselineRun, torch.Tensor]:
    """Full prefill, timed as a user sees it, and its logits at each token of its answer
    (one plain forward over prompt + answer)."""
    run = full_prefill(base.model, partial(tokens, base, prompt), new_tokens)
    ids = torch.tensor([tokens(base, prompt) + run.token_ids[:-1]], device=base.model.device)
    with torch.inference_mode():
        logits = base.model(ids, logits_to_keep=len(run.token_ids)).logits[0].float()
    return run, logits


def measure(
    base: KVBoost,
    engines: dict[str, KVBoost],
    prompts: list[tasks.Prompt],
    answers: list[str],
    new_tokens: int,
    where: list[str] | None = None,
) -> dict[str, FrontRow]:
    """Every engine answers every prompt right after a full prefill of the same tokens.
    ``where``: per prompt, the answering passage's place (first, middle or last)."""
    rows = {name: FrontRow() for name in ["full prefill", *engines]}
    where = where or ["?"] * len(prompts)
    for row in rows.values():
        row.where.extend(where)
    for prompt, answer in zip(prompts, answers):
        ref, ref_logits = reference(base, prompt, new_tokens)
        full = rows["full prefill"]
        full.add_run(ref.ttft_ms, ref.token_ids, ref.total_ms - ref.ttft_ms)
        full.ttlt.append(ref.total_ms)
        full.answers.append(base.tokenizer.decode(ref.token_ids, True))
        full.correct.append(tasks.is_correct(answer, full.answers[-1]))
        for name, engine in engines.items():
            result = ask(engine, prompt, new_tokens)
            logits = engine.answer_logits(prompt, ref.token_ids)
            row = rows[name]
            row.add_run(result.ttft_ms, result.token_ids, result.timings.decode_ms)
            row.top1.append(int(logits[0].argmax()) == ref.token_ids[0])
            row.kl.append(kl_div(ref_logits, logits) / len(ref.token_ids))  # mean per token
            row.greedy.append(result.token_ids == ref.token_ids)
            row.correct.append(tasks.is_correct(answer, result.text))
            row.ttlt.append(result.ttft_ms + result.timings.decode_ms)
            row.answers.append(result.text)
            row.reuse.append(result.kv_reuse_ratio)
            row.foreign.append(result.passages_foreign)
            row.missed.append(result.passages_missed)
            row.computed.append(result.recomputed_tokens / max(result.prompt_tokens, 1))
            row.probe_ms.append(result.timings.repair_ms)
    return rows


KEEP = (
    "median_ttft_ms", "p90_ttft_ms", "speedup", "accuracy_pct", "greedy16_match_pct", "mean_kl",
    "top1_agreement_pct", "reuse_pct", "decode_tok_s",
)  # fmt: skip


def lines(rows: dict[str, FrontRow]) -> dict[str, dict[str, Any]]:
    """Each option's numbers: ``metrics.summary``'s against full prefill, the accuracy as
    a share of full prefill's, the share of full prefill's right answers it kept (the same
    query right here too), time to the last token and its speed-up, passages foreign and
    missed per request, and every answer."""
    full = rows["full prefill"]
    base_ttft, base_ttlt = median(full.ttft), median(full.ttlt)
    base_accuracy = summary(rows["full prefill"], base_ttft, None)["accuracy_pct"]
    out = {}
    for name, row in rows.items():
        s = summary(row, base_ttft, None)
        line = {k: s[k] for k in KEEP}
        share = 100 * s["accuracy_pct"] / base_accuracy if base_accuracy else None
        line["accuracy_share_pct"] = share
        kept = [mine for mine, theirs in zip(row.correct, full.correct) if theirs]
        line["kept"] = [sum(kept), len(kept)]
        line["median_ttlt_ms"] = median(row.ttlt)
        line["ttlt_speedup"] = base_ttlt / median(row.ttlt)
        line["answers"] = row.answers
        line["passages_foreign"] = _mean(row.foreign)
        line["passages_missed"] = _mean(row.missed)
        line["computed_pct"] = 100 * sum(row.computed) / len(row.computed) if row.computed else None
        line["probe_ms"] = median(row.probe_ms) if row.probe_ms else None
        line["accuracy_by_place_pct"] = {
            place: 100 * _mean([c for c, w in zip(row.correct, row.where) if w == place])  # type: ignore[operator]
            for place in PLACES
            if place in row.where
        }
        out[name] = line
    return out


PLACES = ("first", "middle", "last")


def place(position: int, passages: int) -> str:
    """Where a passage at ``position`` of ``passages`` sits."""
    return "first" if position == 0 else "last" if position == passages - 1 else "middle"


def _mean(values: list[int]) -> float | None:
    return sum(values) / len(values) if values else None


def warm_up(base: KVBoost, engines: dict[str, KVBoost]) -> None:
    """One untimed passage prompt per engine (warmed, answered, teacher-forced, then
    forgotten), so one-time costs (first passes, the probe's eager attention, allocator
    growth) land on no option's numbers. Its system prompt is no workload's, so the
    prefixes the workloads use stay unseen."""
    texts = ["One two three four five six seven. " * 12, "Red green blue and white. " * 12]
    query = tasks.Query(texts, "Which colour comes after green?", "")
    prompt = tasks.prompt(base.tokenizer, "fact", "format_passages", query, "Warm-up.")
    prefix = tasks.warm_prefix(base.tokenizer, "fact", "format_passages", "Warm-up.")
    ref, _ = reference(base, prompt, 2)
    systems.warm(engines, texts, prefix)
    for engine in engines.values():
        ask(engine, prompt, 2)
        engine.answer_logits(prompt, ref.token_ids)
        engine.clear_cache()
