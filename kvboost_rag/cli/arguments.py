"""Command-line parsing shared by ``kvboost-rag`` and its benchmark workloads: bad usage is
one line on stderr and exit status 2 (argparse's own status), and values are checked as they
are parsed, so a command never starts work it cannot finish with what it was given."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from kvboost_rag.core.model.loading import check_dtype
from kvboost_rag.core.model.quantized import WEIGHTS

USAGE = 2  # exit status of a command line that is wrong (argparse's)
FAILED = 1  # exit status of a command that ran and could not do its job


class CommandFailed(Exception):
    """The command ran and could not do its job (exit status 1)."""


class BadUsage(Exception):
    """What the command was given cannot be done, found after parsing (exit status 2)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line: ``prog: error: message (see prog
    --help)`` instead of the usage text and the message."""

    def error(self, message: str) -> NoReturn:
        say(self.prog, f"{message} (see {self.prog} --help)")
        raise SystemExit(USAGE)


def say(prog: str, message: object) -> None:
    """One line on stderr: ``prog: error: message``, newlines in the message folded."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)


def one_line(message: object) -> str:
    return re.sub(r"\s*\n\s*", " ", str(message)).strip()


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


def between(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an int in [``low``, ``high``]."""
    above = at_least(low)

    def parse(text: str) -> int:
        value = above(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {value}")
        return value

    parse.__name__ = f"int in [{low}, {high}]"
    return parse


positive = at_least(1)


def dtype_name(text: str) -> str:
    """An argparse type: a dtype the engine loads models in ("float32", "bfloat16", ...)."""
    try:
        check_dtype(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def folder(text: str) -> Path:
    """An argparse type: a folder that exists."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such folder: {text}")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    return path


def cache_folder(text: str) -> Path:
    """An argparse type: a folder to keep a cache in (made when missing), not a file."""
    path = Path(text)
    for above in [path, *path.parents]:
        if above.exists():
            if not above.is_dir():
                what = "is a file" if above == path else f"is under {above}, a file"
                raise argparse.ArgumentTypeError(f"{text} {what}: pass a folder")
            break
    return path


def positive_list(text: str) -> list[int]:
    """An argparse type: comma-separated ints >= 1 ("12,64,256")."""
    return [positive(part.strip()) for part in text.split(",")]


def one_of(*names: str) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names, each one of ``names`` ("whole,mlps")."""

    def parse(text: str) -> list[str]:
        picked = [part.strip() for part in text.split(",")]
        for part in picked:
            if part not in names:
                raise argparse.ArgumentTypeError(f"{part!r} is not one of {', '.join(names)}")
        return picked

    parse.__name__ = "names"
    return parse


def weights_list(text: str) -> list[str | None]:
    """An argparse type: comma-separated ways to store a model's linear weights
    ("checkpoint,int8,int4"; checkpoint: as it has them, None)."""
    picked: list[str | None] = []
    for part in (p.strip() for p in text.split(",")):
        if part != "checkpoint" and part not in WEIGHTS:
            names = ", ".join(("checkpoint", *WEIGHTS))
            raise argparse.ArgumentTypeError(f"{part!r} is not one of {names}")
        picked.append(None if part == "checkpoint" else part)
    return picked


WEIGHTS_HELP = (
    "how the linear weights are stored: dense (float), gguf (a GGUF file's own 4/8-bit "
    "blocks; an AVX512-VNNI CPU), or int8 / int4 / int8-dynamic (quantized from float "
    "weights; CPU); default: the file decides (a GGUF of Q4_K / Q6_K / Q5_0 / Q8_0 tensors "
    "on its blocks where their kernel runs, anything else float)"
)


def add_weights(parser: argparse.ArgumentParser) -> None:
    """``--weights``: how the model's linear weights are stored, as
    ``KVBoost.from_pretrained(weights=)`` takes it (default: what the file decides)."""
    parser.add_argument("--weights", choices=list(WEIGHTS), help=WEIGHTS_HELP)


def dtype_list(text: str) -> list[str]:
    """An argparse type: comma-separated dtype names ("bfloat16,float32")."""
    return [dtype_name(part.strip()) for part in text.split(",")]
