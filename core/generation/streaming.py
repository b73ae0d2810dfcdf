"""Turning generated token ids into text deltas, timing the first token, stopping early."""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import torch
from transformers import StoppingCriteria
from transformers.generation.streamers import BaseStreamer


class TokenCollector(BaseStreamer):
    """Receives tokens from ``generate``: records the first token's time, forwards ids.

    ``generate`` first puts the prompt, then one tensor per new token.
    """

    def __init__(self, on_token: Callable[[int], None] | None = None) -> None:
        self.first_token_at: float | None = None
        self.token_ids: list[int] = []
        self._on_token = on_token
        self._saw_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._saw_prompt:
            self._saw_prompt = True
            return
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        for token in value.reshape(-1).tolist():
            self.token_ids.append(int(token))
            if self._on_token is not None:
                self._on_token(int(token))

    def end(self) -> None:
        pass

    def expect_prompt(self) -> None:
        """The next ``put`` is a prompt again (``generate`` called to continue)."""
        self._saw_prompt = False


class Cancelled(StoppingCriteria):
    """Stops generation when the flag is set (a stream consumer went away)."""

    def __init__(self) -> None:
        self.flag = threading.Event()

    def __call__(
        self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object
    ) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.flag.is_set(), dtype=torch.bool)


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """The text before the earliest stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


def safe_prefix_len(text: str, stops: Sequence[str]) -> int:
    """How much of ``text`` can be shown now: hold back a tail that could start a stop
    string, and a trailing replacement char (an incomplete UTF-8 sequence)."""
    end = len(text)
    if text.endswith("\ufffd"):
        end = len(text.rstrip("\ufffd"))
    for stop in stops:
        for n in range(min(len(stop) - 1, end), 0, -1):
            if text[:end].endswith(stop[:n]):
                end = min(end, len(text[:end]) - n)
                break
    return end


class DeltaQueue:
    """Thread-safe hand-off of text deltas from the generating thread to a consumer."""

    _DONE = object()

    def __init__(self) -> None:
        self._queue: queue.Queue[object] = queue.Queue()

    def put(self, delta: str) -> None:
        if delta:
            self._queue.put(delta)

    def close(self, error: BaseException | None = None) -> None:
        self._queue.put(error if error is not None else self._DONE)

    def __iter__(self):  # type: ignore[no-untyped-def]
        while True:
            item = self._queue.get()
            if item is self._DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class TextDeltas:
    """Turns a growing list of token ids into text deltas that never cross a stop string."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stops: Sequence[str],
        out: DeltaQueue,
        visible: Callable[[str], str] | None = None,
    ) -> None:
        self._decode = decode
        self._stops = stops
        self._visible = visible
        self._out = out
        self._ids: list[int] = []
        self._emitted = 0

    def on_token(self, token: int) -> None:
        self._ids.append(token)
        text, _ = cut_at_stop(self._decode(self._ids), self._stops)
        if self._visible is not None:  # e.g. hold back a tool call being written
            text = self._visible(text)
        self._emit_upto(text, safe_prefix_len(text, self._stops))

    def finish(self, final_text: str) -> None:
        self._emit_upto(final_text, len(final_text))

    def _emit_upto(self, text: str, end: int) -> None:
        if end > self._emitted:
            self._out.put(text[self._emitted : end])
            self._emitted = end


class GenerationStream:
    """Iterate for text deltas; ``result`` holds the ``GenerationResult`` once it ends.

    Generation runs in a background thread. Leaving the loop early (``break``) or calling
    ``close()`` cancels it.
    """

    def __init__(
        self,
        run: Callable[[Callable[[int], None], Cancelled], object],
        decode: Callable[[list[int]], str],
        stops: Sequence[str],
        visible: Callable[[str], str] | None = None,
    ) -> None:
        self.result: object | None = None
        self._queue = DeltaQueue()
        self._deltas = TextDeltas(decode, stops, self._queue, visible)
        self._cancel = Cancelled()
        self._thread = threading.Thread(target=self._work, args=(run,), daemon=True)
        _LIVE.add(self)
        self._thread.start()

    def _work(self, run: Callable[[Callable[[int], None], Cancelled], object]) -> None:
        try:
            self.result = run(self._deltas.on_token, self._cancel)
            self._deltas.finish(self.result.text)  # type: ignore[attr-defined]
            self._queue.close()
        except BaseException as error:  # handed to the consumer, re-raised there
            self._queue.close(error)

    def __iter__(self):  # type: ignore[no-untyped-def]
        try:
            yield from self._queue
        finally:
            if self._thread.is_alive():
                self._cancel.flag.set()
            self._thread.join()

    def close(self) -> None:
        self._cancel.flag.set()
        self._thread.join()


# Streams whose generation may still be running. A daemon thread still inside torch when
# the interpreter finalizes aborts the process ("terminate called without an active
# exception", exit code 134), so at exit every stream nobody finished is cancelled (it
# stops at the next token) and joined.
_LIVE: weakref.WeakSet[GenerationStream] = weakref.WeakSet()


@atexit.register
def _cancel_live_streams() -> None:
    for stream in list(_LIVE):
        stream._cancel.flag.set()
        stream._thread.join()
