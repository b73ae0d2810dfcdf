"""Turning generated token ids into text deltas that never cross a stop string."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, cast

from kvboost_rag.core.results import GenerationResult

if TYPE_CHECKING:
    from kvboost_rag.core.generation.request import Request


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """The text before the earliest stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


def complete(text: str) -> str:
    """``text`` without a partial last character: the replacement chars (U+FFFD) that a
    tokenizer decodes an incomplete UTF-8 sequence at its end to, the rest of whose bytes
    were not generated (yet, while streaming; ever, once an answer ends there)."""
    return text.rstrip("\ufffd")


def safe_prefix_len(text: str, stops: Sequence[str]) -> int:
    """How much of ``text`` can be shown now: hold back a tail that could start a stop
    string, and a partial last character (``complete``)."""
    end = len(complete(text))
    for stop in stops:
        for n in range(min(len(stop) - 1, end), 0, -1):
            if text[:end].endswith(stop[:n]):
                end = min(end, len(text[:end]) - n)
                break
    return end


class DeltaQueue:
    """Thread-safe hand-off of text deltas from the executor's thread to a consumer."""

    DONE = object()

    def __init__(self) -> None:
        self._queue: queue.Queue[object] = queue.Queue()

    def put(self, delta: tuple[str, int]) -> None:
        if delta[0]:
            self._queue.put(delta)

    def close(self, error: BaseException | None = None) -> None:
        self._queue.put(error if error is not None else self.DONE)

    def get(self) -> object:
        return self._queue.get()


class TextDeltas:
    """Turns a growing list of token ids into text deltas that never cross a stop string,
    each with the number of tokens it was made from."""

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
            self._out.put((text[self._emitted : end], len(self._ids)))
            self._emitted = end


class GenerationStream:
    """Iterate for text deltas; ``result`` holds the ``GenerationResult`` once it ends
    (None until then).

    The request runs on the model's executor, which hands each token over as it is chosen.
    A stream is an iterator: once it has ended, iterating it again yields nothing (its text
    is in ``result.text``). Leaving the loop early (``break``) or calling ``close()``
    cancels the request; ``result`` then holds what was yielded.
    """

    def __init__(
        self,
        request: Request,
        decode: Callable[[list[int]], str],
        stops: Sequence[str],
        visible: Callable[[str], str] | None = None,
    ) -> None:
        self.result: GenerationResult | None = None
        self._request = request
        self._queue = DeltaQueue()
        self._deltas = TextDeltas(decode, stops, self._queue, visible)
        self._ended = False  # the end marker was read
        self._text: list[str] = []  # what was yielded
        self._tokens = 0  # tokens behind what was yielded
        request.on_token = self._deltas.on_token
        request.on_end = self._on_end

    def _on_end(self, request: Request) -> None:
        """On the executor's thread, once the request has ended."""
        if request.error is not None:
            self._queue.close(request.error)
            return
        assert request.result is not None
        self.result = request.result
        self._deltas.finish(request.result.text)
        self._queue.close()

    def __iter__(self) -> Iterator[str]:
        try:
            while not self._ended:
                item = self._queue.get()
                if item is DeltaQueue.DONE or isinstance(item, BaseException):
                    self._ended = True
                    if isinstance(item, BaseException):
                        raise item
                    return
                delta, tokens = cast(tuple[str, int], item)
                self._text.append(delta)
                self._tokens = tokens
                yield delta
        finally:
            if not self._ended:
                self.close()

    def close(self) -> None:
        """Cancel the request (if it still runs) and wait for it to end."""
        if self._request.done.is_set() and self._ended:
            return
        self._request.cancel.set()
        self._request.done.wait()
        self._ended = True
        result = self._request.result
        if result is not None and result.finish_reason == "cancelled":
            # What the consumer saw, not the tokens chosen after it stopped reading.
            self.result = replace(
                result, text="".join(self._text), token_ids=result.token_ids[: self._tokens]
            )
