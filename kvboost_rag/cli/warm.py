"""``kvboost-rag warm FOLDER``: encode a folder of text files as passages into the disk
and / or shared tier (``--cache-dir``, ``--remote-url``), or into a running server's tiers
(``--server``). Flags are checked before the model loads (bad usage: one line, exit 2); a
write that does not reach a tier fails the command (exit 1)."""

from __future__ import annotations

import argparse
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvboost_rag.cli.arguments import (
    BadUsage,
    CommandFailed,
    add_weights,
    cache_folder,
    dtype_name,
    folder,
)
from kvboost_rag.cli.serve import API_KEY_VARIABLE

if TYPE_CHECKING:
    from kvboost_rag.core.results import WarmResult


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
    from kvboost_rag.cli.warm_server import warm_through
    from kvboost_rag.core.results import WarmResult

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
    key = args.api_key or os.environ.get(API_KEY_VARIABLE)
    summary = warm_through(args.server, key, [t.page_content for t in texts], layout)
    counts = {name: summary[name] for name in WarmResult.__dataclass_fields__ if name in summary}
    lists = {name: tuple(summary.get(name, ())) for name in ("failed", "pieces")}
    report = WarmResult(**{**counts, **lists})
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


def add_parser(sub: Any) -> None:
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
        help=f"--server's API key (default: the environment variable {API_KEY_VARIABLE})",
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
    add_weights(w)
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
