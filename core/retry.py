"""Chat answers decoded again as text: a call the repeat guard withholds
(``tools/repeats.py``), and an answer that offered tools and came back empty.

The retry goes on from where the first answer's calls began (its content before them is
kept, so a stream never takes back what it showed), with calls refused by the grammar
(``tool_choice="none"``, ``structure.TEXT_ONLY``: text, never empty). The prompt is the
first try's, tools included, so its KV is read from the cache the first try filled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, replace

from typing_extensions import Unpack

from kvboost_rag.core.generation.request import Request
from kvboost_rag.core.generation.sampling import SamplingOptions
from kvboost_rag.core.generation.streaming import GenerationStream, Retrying
from kvboost_rag.core.prompt.chunker import TokenizedPrompt
from kvboost_rag.core.requests import Requests
from kvboost_rag.core.results import GenerationResult, Timings
from kvboost_rag.core.tools.calls import ToolCall
from kvboost_rag.core.tools.repeats import RepeatGuard, kept_tokens
from kvboost_rag.core.tools.structure import Structure

# What a request is opened with: the prompt, sampling options, structure, start time and
# the repeat guard over its messages (None: nothing to guard).
Opened = tuple[TokenizedPrompt, SamplingOptions, Structure, float, RepeatGuard | None]


def answered(requests: Requests, *opened: Unpack[Opened]) -> GenerationResult:
    """A request's answer, decoded again as text where ``again`` says so."""
    prompt, sampling, structure, start, guard = opened
    first = requests.open(prompt, sampling, structure, start).wait()
    retry = again(prompt, sampling, structure, guard, first, requests.decode)
    if retry is None:
        return first
    return retry.joined(requests.open(*retry.opened(start)).wait())


def streamed(requests: Requests, *opened: Unpack[Opened]) -> GenerationStream:
    """A request's stream; where its answer offered tools, a retry streams on after it."""
    prompt, sampling, structure, start, guard = opened
    streams: list[GenerationStream] = []

    def attach(request: Request) -> None:
        follows = follow if structure.calls_parsed else None
        streams.append(
            GenerationStream(request, requests.decode, sampling.stop, structure.visible, follows)
        )

    def follow(first: GenerationResult) -> Retrying | None:
        retry = again(prompt, sampling, structure, guard, first, requests.decode)
        if retry is None:
            return None
        reopened = retry.opened(start)
        return retry.kept, retry.joined, lambda on: requests.open(*reopened, stream=on)

    requests.open(prompt, sampling, structure, start, stream=attach)
    return streams[0]


@dataclass(frozen=True)
class Again:
    """A retry to open, and how its result joins the first try's."""

    prompt: TokenizedPrompt
    sampling: SamplingOptions
    structure: Structure
    first: GenerationResult
    kept: int  # tokens of the first answer the retry goes on after
    kept_text: str
    withheld: list[ToolCall]
    why: str

    def opened(self, start: float) -> tuple[TokenizedPrompt, SamplingOptions, Structure, float]:
        return self.prompt, self.sampling, self.structure, start

    def joined(self, retry: GenerationResult) -> GenerationResult:
        """The answer the caller gets: the first try's kept content and the retry's text,
        counted against the prompt the caller sent; each stage's time is both tries'."""
        first = self.first
        return replace(
            retry,
            text=self.kept_text + retry.text,
            token_ids=first.token_ids[: self.kept] + retry.token_ids,
            prompt_tokens=first.prompt_tokens,
            reused_tokens=first.reused_tokens,
            recomputed_tokens=first.recomputed_tokens,
            timings=_summed(first.timings, retry.timings),
            passages_hit=first.passages_hit,
            passages_missed=first.passages_missed,
            passages_unused=first.passages_unused,
            passages_foreign=first.passages_foreign,
            reuse_reason=first.reuse_reason,
            withheld_tool_calls=self.withheld,
            retried=self.why,
        )


def again(
    prompt: TokenizedPrompt,
    sampling: SamplingOptions,
    structure: Structure,
    guard: RepeatGuard | None,
    first: GenerationResult,
    decode: Callable[[list[int]], str],
) -> Again | None:
    """The retry ``first`` needs, or None: it repeats an answered call (with ``guard``),
    or it offered tools and holds neither text nor a call."""
    if not structure.calls_parsed or first.finish_reason not in ("stop", "tool_calls"):
        return None
    withheld = guard.repeated(first.tool_calls) if guard is not None else []
    if withheld:
        names = ", ".join(sorted({c.name for c in withheld}))
        why = f"repeat guard: {names} was called with these arguments before; answered as text"
    elif not first.text.strip() and not first.tool_calls and not first.invalid_tool_calls:
        why = "empty answer: decoded again as text"
    else:
        return None
    ids = first.token_ids
    kept = kept_tokens(ids, first.text, decode) if first.tool_calls else 0
    left = sampling.max_new_tokens - kept
    if left < 1:
        return None
    text_only = replace(structure, tool_choice="none", constrain=True, parallel=False)
    return Again(
        TokenizedPrompt(prompt.tokens + ids[:kept], prompt.passages),
        replace(sampling, max_new_tokens=left),
        text_only,
        first,
        kept,
        decode(list(ids[:kept])),
        withheld,
        why,
    )


def _summed(a: Timings, b: Timings) -> Timings:
    """Both tries' time in each stage (the prompt was tokenized once)."""
    fields = [f.name for f in dataclasses.fields(Timings) if f.name != "tokenize_ms"]
    return replace(a, **{name: getattr(a, name) + getattr(b, name) for name in fields})
