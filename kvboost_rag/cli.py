"""The ``kvboost-rag`` command: ``demo`` (the README's main job), ``bench`` and ``warm``."""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from pathlib import Path

# Workload -> its module under kvboost_rag.bench, imported only when that workload runs:
# `demo` and `warm` never load the benchmark package.
BENCHES = {
    "agent": "agent",
    "all": "suite",
    "chat": "chat",
    "cluster": "cluster",
    "constrained": "constrained",
    "faults": "faults",
    "front": "front",
    "load": "load",
    "rag": "rag",
    "remote": "remote",
    "warm": "warm",
}


def bench(argv: list[str]) -> None:
    """``bench [workload] [options]``: the options go to the workload's own parser."""
    workload, rest = (argv[0], argv[1:]) if argv and argv[0] in BENCHES else ("all", argv)
    module = importlib.import_module(f"kvboost_rag.bench.{BENCHES[workload]}")
    module.main(rest)


def demo(args: argparse.Namespace) -> None:
    from kvboost_rag.demo import demo as run_demo

    run_demo(args)


def warm_folder(args: argparse.Namespace) -> None:
    """Warm every matching text file of a folder into ``--cache-dir`` and / or
    ``--remote-url`` and print the report."""
    from kvboost_rag import KVBoost, KVBoostConfig, warm_corpus
    from kvboost_rag.warm import chat_prefix

    if args.cache_dir is None and args.remote_url is None:
        raise SystemExit("warm needs --cache-dir, --remote-url or both: where the KV goes")
    files = sorted(p for p in args.folder.glob(args.glob) if p.is_file())
    if not files:
        raise SystemExit(f"no files match {args.glob!r} in {args.folder}")
    texts, skipped = read_texts(files, args.strict)
    if not texts:
        raise SystemExit(f"none of the {len(files)} files in {args.folder} can be warmed")
    config = KVBoostConfig(
        cache_dir=args.cache_dir,
        fidelity=args.fidelity,
        remote_url=args.remote_url,
        remote_namespace=args.remote_namespace,
        kv_codec=args.kv_codec,
    )
    engine = KVBoost.from_pretrained(args.model, dtype=args.dtype, config=config)
    prefix = chat_prefix(args.system) if args.system is not None else args.prefix
    report = warm_corpus(engine, texts, prefix=prefix)
    print(
        f"warmed {report.documents} files into {report.units} passages "
        f"({report.tokens} tokens; {report.new} new, {report.cached} already cached) in "
        f"{report.seconds:.1f} s = {report.tokens_per_s:.0f} tokens/s"
        + (f"; skipped {skipped} files (warned above)" if skipped else "")
    )
    stats = engine.stats()
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


def read_texts(files: list[Path], strict: bool) -> tuple[list[str], int]:
    """The text of each file; a file that is not UTF-8 text or has none is skipped with a
    warning naming it (``strict``: the command stops there with that message)."""
    texts, skipped = [], 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
            problem = None if text.strip() else "it is empty"
        except UnicodeDecodeError as error:
            problem = f"it is not UTF-8 text (byte {error.start}: {error.reason})"
        except OSError as error:
            problem = f"it cannot be read ({error.strerror})"
        if problem is None:
            texts.append(text)
            continue
        if strict:
            raise SystemExit(f"{path}: {problem}")
        warnings.warn(f"skipping {path}: {problem}", stacklevel=2)
        skipped += 1
    return texts, skipped


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvboost-rag", description="kvboost-rag tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="chat and RAG on the embedded model, with timings")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: auto)")
    p.add_argument("--chunks", type=int, default=96, help="essay chunks to index and warm")
    p.add_argument("--chunk-tokens", type=int, default=200)
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.set_defaults(func=demo)
    # Listed for --help only: main() hands bench's arguments to the workload's own parser,
    # so options and their values pass through whatever they look like.
    sub.add_parser(
        "bench",
        help="bench [--quick]: every workload and system in one run; "
        "bench agent|chat|constrained|faults|front|load|rag|remote|warm ...: one workload",
    )
    w = sub.add_parser(
        "warm",
        help="warm a folder of text files into a cache_dir and / or Redis",
        description="Encode each text file as a passage into --cache-dir and / or the "
        "shared tier at --remote-url. Passage KV is "
        "cached for the prompt text before the passages: give --prefix or --system as your "
        "prompts will have it (without either, a generic variant that any prompt reuses at "
        "lower quality).",
    )
    w.add_argument("folder", type=Path)
    w.add_argument("--cache-dir", help="the disk tier every process of this machine reads")
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
    w.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: auto)")
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
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        bench(argv[1:])
        return
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
