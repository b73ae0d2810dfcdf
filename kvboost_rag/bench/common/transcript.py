"""What every benchmark prints: its table (also kept as the text beside its JSON) and
progress lines on stderr."""

from __future__ import annotations

import sys
import time


class Transcript:
    """Prints lines and keeps them."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def say(self, line: str = "") -> None:
        print(line)
        self.lines.append(line)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def note(text: str) -> None:
    """A progress line on stderr (a record run takes minutes)."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)
