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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from kvboost_rag import model_commands, serve_command
from kvboost_rag.arguments import (
    FAILED,
    USAGE,
    ArgumentParser,
    BadUsage,
    CommandFailed,
    between,
    cache_folder,
    dtype_name,
    folder,
    one_line,
    positive,
    say,
)
from kvboost_rag.core.model.quantized import WEIGHTS

if TYPE_CHECKING:
    from kvboost_rag.core.results import WarmResult

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
    from kvboost_rag.demo import demo as run_demo

    run_demo(args)


def warm_folder(args: argparse.Namespace) -> None:
    """Warm every matching text file of a folder into ``--cache-dir`` and / or
    ``--remote-url`` and print the report."""
    from kvboost_rag import KVBoost, KVBoostConfig, warm_corpus
    from kvboost_rag.core.prompt.chunker import parse_segments
    from kvboost_rag.warm import chat_prefix

    if args.server is not None:
        warm_on_server(args)
        return
    if args.api_key is not None:
        raise BadUsage("--api-key is --server's key: give --server URL too")
    if args.cache_dir is None and args.remote_url is None:
        raise BadUsage(
            "warm needs --cache-dir, --remote-url or both (where the KV goes), or --server"
        )
    config = KVBoostConfig(  # checks the values first: bad usage is found before any work
        cache_dir=args.cache_dir,
        fidelity=args.fidelity,
        remote_url=args.remote_url,
        remote_namespace=args.remote_namespace,
        kv_codec=args.kv_codec,
    )
    files = folder_files(args)
    if args.cache_dir is not None:
        try:  # here, before the model loads: the engine would warn and keep KV in memory
            args.cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            message = f"--cache-dir {args.cache_dir} cannot be made: {error.strerror}"
            raise BadUsage(message) from None
    for layout in (args.prefix, args.system):
        if layout is not None:
            parse_segments(layout)  # a stray passage marker (MarkerError), before the model
    engine = KVBoost.from_pretrained(
        args.model, dtype=args.dtype, weights=args.weights, config=config
    )
    prefix = chat_prefix(args.system) if args.system is not None else args.prefix
    engine.passage_prefix(prefix)  # a layout the engine cannot use is bad usage too
    texts, skipped = read_texts(files, args.strict)
    if not texts:
        raise CommandFailed(f"none of the {len(files)} files in {args.folder} can be warmed")
    try:
        report = warm_corpus(engine, texts, prefix=prefix)
    except ValueError as error:  # a file that cannot be a passage: the data, not the usage
        raise CommandFailed(str(error)) from error
    print(warmed_line(report, skipped))
    stats = engine.stats()
    if "disk" in report.failed:
        raise CommandFailed(f"nothing was stored in {args.cache_dir}: it cannot hold a cache")
    if stats.disk is not None:
        print(
            f"disk: {stats.disk.bytes / 2**20:.0f} MiB in {stats.disk.entries} files "
            f"under {args.cache_dir}"
        )
    if stats.remote is not None:
        remote = stats.remote
        print(
            f"shared tier {remote.url}: {remote.writes} values written "
            f"({remote.written_bytes / 2**20:.0f} MiB), {remote.skipped} already there or "
            f"skipped, {remote.errors} errors"
        )
        if "remote" in report.failed:  # the report's verdict, as warm_corpus callers read it
            raise CommandFailed(
                f"the shared tier {remote.url} failed ({remote.errors} errors): the corpus is "
                "not all stored there; rerun once it answers (what is there is kept)"
            )


def warm_on_server(args: argparse.Namespace) -> None:
    """Warm the folder's files on a running ``kvboost-rag serve`` (its engine and tiers)."""
    from kvboost_rag.core.results import WarmResult
    from kvboost_rag.warm_server import warm_through

    if args.cache_dir is not None or args.remote_url is not None:
        raise BadUsage(
            "--server warms that server's engine and tiers: give --cache-dir / --remote-url "
            "to its `kvboost-rag serve`, not here"
        )
    if not args.server.startswith(("http://", "https://")):
        raise BadUsage(f"--server must be an http:// or https:// URL, got {args.server!r}")
    files = folder_files(args)
    texts, skipped = read_texts(files, args.strict)
    if not texts:
        raise CommandFailed(f"none of the {len(files)} files in {args.folder} can be warmed")
    layout = {"system": args.system} if args.system is not None else {}
    layout.update({"prefix": args.prefix} if args.prefix is not None else {})
    key = args.api_key or os.environ.get(serve_command.API_KEY_VARIABLE)
    summary = warm_through(args.server, key, [t.page_content for t in texts], layout)
    counts = {name: summary[name] for name in WarmResult.__dataclass_fields__}
    report = WarmResult(**{**counts, "failed": tuple(summary["failed"])})
    print(warmed_line(report, skipped) + f" on {args.server}")
    if report.failed:
        raise CommandFailed(
            f"the server's {' and '.join(report.failed)} tier failed to store the warm "
            "(its log says why); rerun once it can (what is stored is kept)"
        )


def folder_files(args: argparse.Namespace) -> list[Path]:
    files = sorted(p for p in args.folder.glob(args.glob) if p.is_file())
    if not files:
        raise BadUsage(f"no files match {args.glob!r} in {args.folder}")
    return files


def warmed_line(report: WarmResult, skipped: int) -> str:
    return (
        f"warmed {_count(report.documents, 'file')} into {_count(report.units, 'passage')} "
        f"({report.tokens} tokens; {report.new} new, {report.cached} already cached) in "
        f"{report.seconds:.1f} s = {report.tokens_per_s:.0f} tokens/s"
        + (f"; skipped {_count(skipped, 'file')} (warned above)" if skipped else "")
    )


@dataclass(frozen=True)
class FileText:
    """A file's text as warm_corpus takes a document: its errors name the file."""

    page_content: str
    metadata: dict[str, str]


def read_texts(files: list[Path], strict: bool) -> tuple[list[FileText], int]:
    """The text of each file; a file that is not UTF-8 text or has none is skipped with a
    warning naming it (``strict``: the command stops there with that message)."""
    texts: list[FileText] = []
    skipped = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
            problem = None if text.strip() else "it is empty"
        except UnicodeDecodeError as error:
            problem = f"it is not UTF-8 text (byte {error.start}: {error.reason})"
        except OSError as error:
            problem = f"it cannot be read ({error.strerror})"
        if problem is None:
            texts.append(FileText(text, {"source": str(path)}))
            continue
        if strict:
            raise CommandFailed(f"{path}: {problem}")
        warnings.warn(f"skipping {path}: {problem}", stacklevel=2)
        skipped += 1
    return texts, skipped


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


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
    p.add_argument(
        "--weights",
        choices=list(WEIGHTS),
        help="store the linear weights quantized (CPU; default: the checkpoint's)",
    )
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
    _warm_parser(sub)
    serve_command.add_parser(sub)
    model_commands.add_parsers(sub)
    return parser


def _questions() -> list[str]:
    from kvboost_rag.demo import QUESTIONS

    return QUESTIONS


def _warm_parser(sub: Any) -> None:
    w = sub.add_parser(
        "warm",
        help="warm a folder of text files into a cache_dir and / or Redis, or a server",
        description="Encode each text file as a passage into --cache-dir and / or the "
        "shared tier at --remote-url. Passage KV is "
        "cached for the prompt text before the passages: give --prefix or --system as your "
        "prompts will have it (without either, a generic variant that any prompt reuses at "
        "lower quality).",
    )
    w.add_argument("folder", type=folder)
    w.add_argument(
        "--server",
        metavar="URL",
        help="warm a running `kvboost-rag serve` at URL (http://127.0.0.1:8000) instead: "
        "its engine encodes and stores the files, in the tiers it was started with",
    )
    w.add_argument(
        "--api-key",
        help=f"--server's API key (default: the environment variable "
        f"{serve_command.API_KEY_VARIABLE})",
    )
    w.add_argument(
        "--cache-dir", type=cache_folder, help="the disk tier every process of this machine reads"
    )
    w.add_argument(
        "--remote-url",
        help="the shared tier every machine reads: redis://host:6379/0 (rediss:// for TLS)",
    )
    w.add_argument("--remote-namespace", default="kvboost", help="key prefix in Redis")
    w.add_argument(
        "--kv-codec",
        default="none",
        choices=["none", "int8", "fp8"],
        help="how passage KV is stored on disk and in Redis (readers decode any codec)",
    )
    w.add_argument("--glob", default="*.txt", help="which files of the folder (default *.txt)")
    w.add_argument(
        "--strict",
        action="store_true",
        help="stop at a file that is empty or not UTF-8 text (default: skip it with a warning)",
    )
    w.add_argument("--model", default="smollm2-135m-instruct")
    w.add_argument("--dtype", type=dtype_name, help="float32 or bfloat16 (default: auto)")
    w.add_argument(
        "--weights",
        choices=list(WEIGHTS),
        help="store the linear weights quantized (CPU; default: the checkpoint's)",
    )
    w.add_argument("--fidelity", default="balanced", choices=["balanced", "fast"])
    layout = w.add_mutually_exclusive_group()
    layout.add_argument(
        "--prefix",
        metavar="TEXT",
        help="completion prompts (generate): the exact text they have before the passages, "
        "trailing newline included (bash: $'Context:\\n'); the passages are encoded after it",
    )
    layout.add_argument(
        "--system",
        metavar="TEXT",
        help="chat prompts (chat template): their system message; the passages open the "
        "user message after it (the layout of ChatKVBoost's documents=)",
    )
    w.set_defaults(func=warm_folder)


if __name__ == "__main__":
    main()
