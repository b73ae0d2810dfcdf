"""A function queued for the executor's loop thread, and how its caller waits for it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvboost_rag.core.model.yielding import Preempted


class Job:
    """A function to run on the loop's thread; ``wait`` returns its result."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.urgent = False  # a caller now waits for this background job: it goes first

    def run(self) -> bool:
        """Run ``fn``; False when a request preempted it (it is to run again)."""
        try:
            self.result = self.fn()
        except Preempted:
            return False
        except BaseException as error:  # handed to the waiting caller
            self.error = error
        self.done.set()
        return True

    def hurry(self) -> None:
        """Run this background job before the others queued (a caller waits for it)."""
        self.urgent = True

    def wait(self) -> Any:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result
