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


# A stream's follow-up, asked on the consumer's thread once its request ended: None (the
# result stands) or a retry: how many of the answer's tokens it goes on after, how its
# result joins the first (``core/retry.py``) and how to open it with a stream attached.
Retrying = tuple[
    int,
    Callable[[GenerationResult], GenerationResult],
    Callable[[Callable[["Request"], None]], object],
]
Follow = Callable[[GenerationResult], Retrying | None]


class _Ended:
    """Queued instead of the end when a follow-up may retry: the first try's result."""

    def __init__(self, result: GenerationResult) -> None:
        self.result = result


class DeltaQueue:
    """Thread-safe hand-off of text deltas from the executor's thread to a consumer."""

    DONE = object()

    def __init__(self) -> None:
        self._queue: queue.Queue[object] = queue.Queue()

    def put(self, delta: tuple[str, int] | _Ended) -> None:
        if isinstance(delta, _Ended) or delta[0]:
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

    def restart(self, ids: list[int]) -> None:
        """Go on after ``ids`` (a retry keeps the first answer's first tokens): what was
        emitted stays emitted."""
        self._ids = list(ids)

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
    cancels the request; ``result`` then holds what was yielded. With ``follow`` (a chat
    answer that may be decoded again, ``core/retry.py``), the retry's deltas follow the
    first try's and ``result`` is set once the consumer has read to the end.
    """

    def __init__(
        self,
        request: Request,
        decode: Callable[[list[int]], str],
        stops: Sequence[str],
        visible: Callable[[str], str] | None = None,
        follow: Follow | None = None,
    ) -> None:
        self.result: GenerationResult | None = None
        self._follow = follow
        self._join: Callable[[GenerationResult], GenerationResult] | None = None
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
        if self._follow is not None and request.result.finish_reason != "cancelled":
            self._queue.put(_Ended(request.result))
            return
        self._end(request.result if self._join is None else self._join(request.result))

    def _end(self, result: GenerationResult) -> None:
        self.result = result
        self._deltas.finish(result.text)
        self._queue.close()

    def _retry(self, first: GenerationResult) -> None:
        """On the consumer's thread: open the follow-up's retry, or end with ``first``."""
        assert self._follow is not None
        retrying, self._follow = self._follow(first), None
        if retrying is None:
            self._end(first)
            return
        kept, self._join, open_retry = retrying
        self._deltas.restart(first.token_ids[:kept])

        def attach(request: Request) -> None:
            self._request = request
            request.on_token = self._deltas.on_token
            request.on_end = self._on_end

        open_retry(attach)

    def __iter__(self) -> Iterator[str]:
        try:
            while not self._ended:
                item = self._queue.get()
                if isinstance(item, _Ended):
                    self._retry(item.result)
                    continue
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
