"""What ``kvboost-rag bench latency`` and ``bench load`` share around their measurement: the
common options, and a run that prints the table and writes its JSON, text and chart."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvboost_rag.bench.common.baseline import write_report
from kvboost_rag.bench.common.transcript import Transcript
from kvboost_rag.cli.arguments import add_weights, positive

Report = dict[str, Any]


def parse_common(
    parser: argparse.ArgumentParser, argv: list[str] | None, quick: dict[str, Any]
) -> argparse.Namespace:
    """``parser``'s own options, then --weights, --seed, --threads, --out and --quick (which
    sets ``quick``'s values); ``args.argv`` keeps the command line for the record."""
    add_weights(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=positive, default=None, help="default: all cores")
    parser.add_argument("--out", type=Path, default=Path("docs/bench"))
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {quick}")
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(quick)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    return args


def run_and_write(
    name: str,
    args: argparse.Namespace,
    record: Callable[[argparse.Namespace], Report],
    table: Callable[[Report], str],
    draw: Callable[[Report, Path], object],
) -> None:
    """Measure, print the table as it is written, and write ``<name>-<dtype>.json`` / .txt
    / .png into ``args.out``."""
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    report = record(args)
    transcript = Transcript()
    for line in table(report).splitlines():
        transcript.say(line)
    dtype = report["machine"]["dtype"] + (f"-{args.weights}" if args.weights else "")
    write_report(args.out, f"{name}-{dtype}.json", report)
    (args.out / f"{name}-{dtype}.txt").write_text(transcript.text())
    draw(report, args.out / f"{name}-{dtype}.png")
