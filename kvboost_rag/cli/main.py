"""The ``kvboost-rag`` command: ``demo`` (the README's main job), ``bench``, ``warm``,
``serve``, ``models`` and ``convert``.

Exit status 0 when the command did its job, 2 for bad usage (a wrong option or value, a
model or folder that is not there: one line on stderr, nothing started), 1 when it ran and
failed (a write that did not reach the disk or the shared tier), 130 when Ctrl-C stopped
it (one line, at once). Warnings are one line each.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import warnings
from collections.abc import Callable
from typing import NoReturn, TextIO

from kvboost_rag.cli import models, serve, warm
from kvboost_rag.cli.arguments import (
    FAILED,
    USAGE,
    ArgumentParser,
    BadUsage,
    CommandFailed,
    add_weights,
    between,
    dtype_name,
    one_line,
    positive,
    say,
)

PROG = "kvboost-rag"
SIGINT_STATUS = 130  # a shell's status for a program ended by Ctrl-C


# Workload -> its module under kvboost_rag.bench, imported only when that workload runs:
# `demo` and `warm` never load the benchmark package. What a user measures on their own
# machine and model.
BENCHES = {"latency": "latency.run", "load": "load.run", "warm": "warm.run"}
# The studies, in the repository's benchmarks/ folder (not in the package): their old
# workload names -> the module a clone runs.
STUDIES = {
    "agent": "agent",
    "all": "suite",
    "chat": "chat",
    "cluster": "cluster",
    "constrained": "constrained",
    "decode": "decode",
    "exactness": "exactness",
    "faults": "faults",
    "front": "front",
    "rag": "rag",
    "remote": "remote",
    "step": "decode.step",
    "tools": "tools",
}


def bench(argv: list[str]) -> None:
    """``bench workload [options]``: the options go to the workload's own parser."""
    workload = argv[0] if argv else ""
    if workload in BENCHES:
        module = importlib.import_module(f"kvboost_rag.bench.{BENCHES[workload]}")
        module.main(argv[1:])
        return
    if workload in STUDIES:
        raise BadUsage(
            f"{workload} is a study in the repository's benchmarks/ folder, not in the "
            f"package: from a clone run `python -m benchmarks.{STUDIES[workload]}`"
        )
    given = f"{workload!r} is not a workload" if workload else "a workload is needed"
    raise BadUsage(
        f"{given}: {' | '.join(BENCHES)} (`{PROG} bench latency --help`); the studies are "
        "in the repository's benchmarks/ folder (from a clone: `python -m benchmarks.suite`)"
    )


def demo(args: argparse.Namespace) -> None:
    from kvboost_rag.cli.demo import demo as run_demo

    run_demo(args)


def main(argv: list[str] | None = None) -> None:
    """Run the command ``argv`` (default ``sys.argv[1:]``); exits with a non-zero status
    (``SystemExit``) when it was misused (2) or failed (1)."""
    argv = sys.argv[1:] if argv is None else argv
    if _on_main_thread():
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning  # one line each, without the source line
            status = _run(argv)
    except KeyboardInterrupt:
        _interrupted(argv)
    if status:
        raise SystemExit(status)


def _on_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _on_sigint(signum: int, frame: object) -> None:
    """Ctrl-C: the stores' background writers stop before the main thread even sees the
    ``KeyboardInterrupt`` (it may be waiting on the model's thread): a warm's queued
    writes landed for a moment after the signal. Imported only if a store was made."""
    writer = sys.modules.get("kvboost_rag.core.store.writer")
    if writer is not None:
        writer.halt()
    raise KeyboardInterrupt


# What a command interrupted by Ctrl-C leaves behind, said with the one line it prints.
AFTER_INTERRUPT = {"warm": "what was stored is kept (rerun to resume)"}


def _interrupted(argv: list[str]) -> NoReturn:
    """Ctrl-C: one line on stderr and exit status 130 (128 + SIGINT), at once. The process
    ends here without joining the engine's threads or flushing its queued writes: a warm
    went on encoding and writing for ~10 s after the signal, then printed a traceback
    (issue 48). Nothing starts after the signal; each entry on disk or in Redis lands
    whole (atomic writes, stale temporary files removed at the next start), so a rerun
    resumes from what was stored."""
    command = argv[0] if argv and not argv[0].startswith("-") else ""
    prog = f"{PROG} {command}".strip()
    after = AFTER_INTERRUPT.get(command)
    sys.stdout.flush()
    # On a line of its own: a progress bar leaves its line open.
    print(f"\n{prog}: interrupted" + (f": {after}" if after else ""), file=sys.stderr, flush=True)
    os._exit(SIGINT_STATUS)


def _run(argv: list[str]) -> int:
    if argv[:1] == ["bench"]:  # the workload's own parser reads the rest
        return _guarded(f"{PROG} bench", lambda: bench(argv[1:]))
    args = parser().parse_args(argv)
    return _guarded(f"{PROG} {args.command}", lambda: args.func(args))


def _guarded(prog: str, command: Callable[[], None]) -> int:
    """``command``'s exit status: what it raised on purpose is one line on stderr."""
    try:
        command()
    except (CommandFailed, OSError) as error:
        say(prog, error)
        return FAILED
    except (BadUsage, ValueError, TypeError) as error:  # a model, URL or value refused
        say(prog, error)
        return USAGE
    return 0


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    text = one_line(message).removeprefix(f"{PROG}: ")
    print(f"{PROG}: warning: {text}", file=file or sys.stderr)


def parser() -> ArgumentParser:
    parser = ArgumentParser(prog=PROG, description="kvboost-rag tools")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    p = sub.add_parser("demo", help="RAG through LangChain and LlamaIndex, with timings")
    # The smallest model whose answers make sense (SmolLM2-135M's did not); any alias or
    # folder works
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--dtype", type=dtype_name, help="float32 or bfloat16 (default: auto)")
    add_weights(p)
    p.add_argument("--chunks", type=positive, default=96, help="essay chunks to index and warm")
    p.add_argument("--chunk-tokens", type=positive, default=200)
    p.add_argument("--questions", type=between(1, len(_questions())), default=3)
    p.add_argument("--max-new-tokens", type=positive, default=40)
    p.set_defaults(func=demo)
    # Listed for --help only: main() hands bench's arguments to the workload's own parser,
    # so options and their values pass through whatever they look like.
    sub.add_parser(
        "bench",
        help="bench latency|load|warm [options]: measure this machine and model (the "
        "studies are in the repository's benchmarks/ folder)",
    )
    warm.add_parser(sub)
    serve.add_parser(sub)
    models.add_parsers(sub)
    return parser


def _questions() -> list[str]:
    from kvboost_rag.cli.demo import QUESTIONS

    return QUESTIONS
