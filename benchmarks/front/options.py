"""The options the fidelity front puts side by side: engine settings by name, and the sets
of them each ``--systems`` choice runs."""

from __future__ import annotations

from typing import Any

OPTIONS: dict[str, dict[str, Any]] = {
    "exact prefix cache": {"fidelity": "exact"},
    "anchor+none": {"fidelity": "fast", "passage_prefix": "anchor", "repair": "none"},
    "anchor+query r=0.30": {"passage_prefix": "anchor", "repair": "query", "recompute_ratio": 0.30},
    "prompt+none": {"fidelity": "fast", "repair": "none"},
    "prompt+query r=0.15": {"repair": "query", "recompute_ratio": 0.15},
    "prompt+query r=0.30": {"repair": "query", "recompute_ratio": 0.30},
    "prompt+query r=0.30 L=8": {"repair": "query", "recompute_ratio": 0.30, "probe_layers": 8},
    "prompt+query r=0.15 L=8": {"repair": "query", "recompute_ratio": 0.15, "probe_layers": 8},
    "prompt+edges k=8": {"repair": "edges", "edge_tokens": 8},
    "prompt+deviation r=0.15": {"repair": "deviation", "recompute_ratio": 0.15},
    "prompt+deviation r=0.20": {"repair": "deviation", "recompute_ratio": 0.20},
    "prompt+deviation r=0.25": {"repair": "deviation", "recompute_ratio": 0.25},
    "prompt+passage r=0.15": {"repair": "passage", "recompute_ratio": 0.15},
    "prompt+passage r=0.30": {"repair": "passage", "recompute_ratio": 0.30},
    "prompt+edges k=4": {"repair": "edges", "edge_tokens": 4},
    "prompt+query r=0.15 L=4": {"repair": "query", "recompute_ratio": 0.15, "probe_layers": 4},
    "prompt+query r=0.30 L=4": {"repair": "query", "recompute_ratio": 0.30, "probe_layers": 4},
    "prompt+query r=0.03 L=4": {"repair": "query", "recompute_ratio": 0.03, "probe_layers": 4},
    "prompt+query r=0.06 L=4": {"repair": "query", "recompute_ratio": 0.06, "probe_layers": 4},
    "prompt+shared r<=0.40": {"repair": "shared", "recompute_ratio": 0.40},
    "prompt+shared r<=0.25": {"repair": "shared", "recompute_ratio": 0.25},
    "prompt+query m=0.3 r<=0.15 L=8": {
        "repair": "query",
        "recompute_ratio": 0.15,
        "probe_layers": 8,
        "recompute_mass": 0.3,
    },
    "prompt+query m=0.5 r<=0.3 L=8": {
        "repair": "query",
        "recompute_ratio": 0.30,
        "probe_layers": 8,
        "recompute_mass": 0.5,
    },
}
SYSTEM_SETS = {
    "front": list(OPTIONS),
    "prefix": ["anchor+none", "prompt+none", "anchor+query r=0.30", "prompt+query r=0.30"],
    # Cheaper probes for balanced: the question run over the first 8 of 30 layers.
    "probe": ["prompt+query r=0.30", "prompt+query r=0.30 L=8", "prompt+query r=0.15 L=8"],
    # The repair options of issue 26 (a probe beside SDPA, budgets on passages that need
    # it), the answer's passage at every position.
    "repair": [
        "exact prefix cache",
        "prompt+none",
        "prompt+edges k=4",
        "prompt+query r=0.15 L=4",
        "prompt+query r=0.30 L=4",
        "prompt+query r=0.15 L=8",
        "prompt+query r=0.30 L=8",
        "prompt+query r=0.15",
        "prompt+query r=0.30",
        "prompt+passage r=0.30",
    ],
    # Issue 26's cheap repairs: a small fixed ratio for "fast", and the adaptive ratio
    # (``recompute_mass``) beside "balanced"'s fixed 15%.
    "adaptive": [
        "prompt+none",
        "prompt+query r=0.03 L=4",
        "prompt+query r=0.06 L=4",
        "prompt+query r=0.15 L=8",
        "prompt+query m=0.3 r<=0.15 L=8",
        "prompt+query m=0.5 r<=0.3 L=8",
    ],
    # CacheBlend's deviation (layer 1's values) beside "balanced"'s question probe: the
    # deviation probe kept most with the answer's passage first.
    "deviation": [
        "prompt+none",
        "prompt+query r=0.15 L=8",
        "prompt+deviation r=0.15",
        "prompt+deviation r=0.20",
        "prompt+deviation r=0.25",
    ],
}
# Real models (issue 46): no repair, the value-deviation repair that was balanced's, and the
# repair of text the passages share.
SYSTEM_SETS["real"] = [
    "exact prefix cache",
    "prompt+none",
    "prompt+deviation r=0.25",
    "prompt+shared r<=0.40",
]
# Issue 47: the default (balanced) with passages marked and found by content alone
# (``--marks marked,plain``), beside the exact prefix cache.
SYSTEM_SETS["marks"] = ["exact prefix cache", "prompt+shared r<=0.40"]
# The foreign-prefix scenario: each fidelity level with each prefix_fallback.
FOREIGN = {
    f"{level}, {fallback}": {"fidelity": level, "prefix_fallback": fallback}
    for level in ("fast", "balanced")
    for fallback in ("nearest", "encode")
}
FOREIGN_SYSTEM = "You are a helpful assistant. Use the documents below to answer."
