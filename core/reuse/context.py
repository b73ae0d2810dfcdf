"""Building one planned prompt's context in its KV row: the exact prefix, reused passages
(encoding the missing ones), repair; what is left is the positions the first forward
computes."""

from __future__ import annotations

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
    # Passages whose KV was read from the passage cache; None on routes that read none.
    passages_hit: int | None = None


def build_context(
    plan: Plan, lookup: Lookup, reuse: PassageReuse | None, row: RowKV, timings: Timings
) -> Context:
    """Runs the model (misses, a repair probe): call it on the executor's thread."""
    with timings.stage("assemble"):
        write_blocks(row, lookup.blocks, plan.exact)
    if plan.route != "reuse":
        return Context(list(range(plan.exact, plan.length + 1)), plan.exact)
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
    return Context(fill, plan.exact + kept, found.hits)


def write_blocks(row: RowKV, blocks: list[LayerKV], upto: int) -> None:
    """The exact prefix: ``blocks`` in order, cut at position ``upto``."""
    start = 0
    for block in blocks:
        if start >= upto:
            return
        n = min(block[0][0].shape[-2], upto - start)
        row.write(start, [(k[:, :, :n], v[:, :, :n]) for k, v in block])
        start += n
