"""Warnings attributed to the line that called into kvboost-rag, whatever the depth of the
package's own frames between it and the warning: a fixed ``stacklevel`` pointed at
``tiers.py:52`` or ``tiers.py:72`` depending on the route a lookup took (issue 48)."""

from __future__ import annotations

import sys
import warnings
from types import FrameType

PACKAGE = "kvboost_rag"
# Where a thread of the package's own starts: no caller of the user's to point at.
_THREAD_STARTS = ("threading", "concurrent.futures.thread")


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` at the first frame outside the package (the
    user's line, or a framework's calling an adapter); on a background thread of the
    package's own, at the package's line that warned."""
    frame: FrameType | None = sys._getframe(1)
    level = 2  # ``warnings.warn``'s count: 1 is this line, 2 the frame above it
    while frame is not None and _module(frame).partition(".")[0] == PACKAGE:
        frame, level = frame.f_back, level + 1
    if frame is None or _module(frame) in _THREAD_STARTS:
        level = 2
    warnings.warn(message, category, stacklevel=level)


def _module(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__", ""))
