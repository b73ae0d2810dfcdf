"""Building one planned prompt's context in its KV row: the exact prefix, reused passages
(encoding the missing ones), repair; what is left is the positions the first forward
computes."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from kvboost_rag.core.model.kv import LayerKV
from kvboost_rag.core.results import Timings
from kvboost_rag.core.reuse.assemble import PassageReuse, RowKV
from kvboost_rag.core.reuse.lookup import Lookup
from kvboost_rag.core.reuse.plan import Plan


@dataclass(frozen=True)
class Context:
    fill: list[int]  # positions still to compute, ascending; the last is the prompt's last
    # token (its logits give the first generated token)
    reused: int  # prompt tokens whose KV came from a cache and was kept
    passages_hit: int = 0  # passages whose stored KV the answer used (some of it kept)
    # Passages the cache held whose KV the answer did not use: the policy prefilled the
    # prompt plainly, or the repair recomputed every position of theirs.
    passages_unused: int = 0
    passages_foreign: int = 0  # of the hits, those encoded after another prefix


def build_context(
    plan: Plan, lookup: Lookup, reuse: PassageReuse | None, row: RowKV, timings: Timings
) -> Context:
    """Runs the model (misses, a repair probe): call it on the executor's thread."""
    with timings.stage("assemble"):
        write_blocks(row, lookup.blocks, plan.exact)
    if plan.route != "reuse":  # what the cache held goes unused
        return Context(list(range(plan.exact, plan.length + 1)), plan.exact, 0, plan.hits)
    assert reuse is not None, "a reuse plan needs passage reuse"
    assert plan.prefix is not None, "a reuse plan knows its passages' prefix"
    passages = [p.tokens for p in plan.passages]
    sources = [p.source for p in plan.passages]
    known = [lookup.passage_kv[p.index] for p in plan.passages]
    with timings.stage("encode" if None in known else "lookup"):
        found = reuse.cache.fetch(plan.prefix, passages, sources, known)
    with timings.stage("assemble"):
        reuse.assemble(plan, found, row)
    with timings.stage("repair"):
        fill, kept = reuse.repair(plan, row)
    stored = [p for p, kv in zip(plan.passages, known) if kv is not None]
    # ``fill`` ascends: a passage is unused when every one of its positions is in it
    used = [
        p for p in stored if bisect_left(fill, p.end) - bisect_left(fill, p.start) < p.end - p.start
    ]
    foreign = sum(p.source != plan.prefix for p in used)
    return Context(fill, plan.exact + kept, len(used), len(stored) - len(used), foreign)


def write_blocks(row: RowKV, blocks: list[LayerKV], upto: int) -> None:
    """The exact prefix: ``blocks`` in order, cut at position ``upto``."""
    start = 0
    for block in blocks:
        if start >= upto:
            return
        n = min(block[0][0].shape[-2], upto - start)
        row.write(start, [(k[:, :, :n], v[:, :, :n]) for k, v in block])
        start += n
