"""What the caches hold for one prompt, read from the tiers before the model is taken.

A request's lookup runs on its caller's thread: the exact prefix cache's longest match (and
the session cache's continuation of it), then the stored variant of each passage after it
(memory, disk, the shared tier). Their KV comes back as plain data, which the reuse policy
turns into a plan without touching storage, and the executor builds the request's
context from it without waiting on storage either.
"""

from __future__ import annotations

from typing import NamedTuple

from kvboost_rag.core.model.kv import LayerKV
from kvboost_rag.core.prompt.placing import Placed
from kvboost_rag.core.reuse.passages import PassageCache, Prefix
from kvboost_rag.core.reuse.plan import after_exact
from kvboost_rag.core.reuse.prefix import PrefixCache
from kvboost_rag.core.reuse.session import SessionCache


class Lookup(NamedTuple):
    matched: int  # prompt tokens the prefix caches hold from position 0
    approx_from: int | None  # where session KV (approximate) starts; None: all exact
    blocks: list[LayerKV]  # KV of those tokens, block by block
    prefix: Prefix | None  # what the prompt's passages are encoded after; None: no reuse
    sources: list[Prefix | None] | None  # per passage, the prefix of its stored variant
    passage_kv: list[LayerKV | None]  # per passage, that variant's KV (None: not found)
    placed: list[Placed]  # the prompt's passages: marked, and found by the passage index
    new: list[Placed]  # passages new to the cache, computed in place, encoded afterwards


def look_up(
    tokens: list[int],
    placed: list[Placed],
    new: list[Placed],
    exact: PrefixCache,
    session: SessionCache | None,
    passages: PassageCache | None,
    own_prefix: bool,
) -> Lookup:
    """``tokens``: the prompt; ``placed``: its passages, in order; ``new``: more of its
    text to store as passages after the answer (not looked up). ``passages`` None: no
    passage reuse. ``own_prefix``: passages are encoded after the prompt's own text
    before its first passage (else after the cache's anchor)."""
    match = exact.match(tokens)
    matched, blocks, approx = match.length, match.blocks, None
    more = session.match(tokens, match.length) if session is not None else None
    if more is not None:
        first = match.length // exact.block_tokens
        matched, blocks, approx = more.length, blocks[:first] + more.blocks, match.length
    if passages is None or not (placed or new):
        return Lookup(matched, approx, blocks, None, None, [], placed, new)
    first = (placed or new)[0].offset  # the prefix is what the known passages follow
    prefix = passages.prefix(tokens[: max(first, 0)] if own_prefix else [])
    sources: list[Prefix | None] = [None] * len(placed)
    kvs: list[LayerKV | None] = [None] * len(placed)
    wanted = after_exact(placed, len(tokens), matched)
    found = passages.find(prefix, [placed[i].tokens for i in wanted])
    for i, (source, kv) in zip(wanted, found):
        sources[i], kvs[i] = source, kv
    return Lookup(matched, approx, blocks, prefix, sources, kvs, placed, new)
