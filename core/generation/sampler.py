"""Choosing each next token as ``generate`` would, for one request.

A request's sampler holds the logits processors and stopping criteria ``generate`` builds
from the model's generation config with the request's options applied (repetition
penalty, min_p, temperature, top-k/p, EOS, stop strings, the length limit), its grammar's
mask among them, and its seeded random stream. The first token (from a repair or prefill
pass) and every later one go through it, so a cached answer decodes what ``generate``
would on the same logits: greedy token for token, seeded sampling draw for draw (a seeded
``generate`` draws from the global stream seeded the same way).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from kvboost_rag.core.generation.sampling import SamplingOptions
from kvboost_rag.core.model import hf_compat


class CancelCriteria(StoppingCriteria):
    """Stops a request once its cancel flag is set (its stream's consumer went away)."""

    def __init__(self, flag: threading.Event) -> None:
        self.flag = flag

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: object) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.flag.is_set(), dtype=torch.bool)


class Sampler:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        sampling: SamplingOptions,
        prompt_tokens: int,
        max_new_tokens: int,
        cancel: threading.Event,
        extra: LogitsProcessorList | None = None,
        stops: StoppingCriteria | None = None,
    ) -> None:
        """``stops``: the matcher of ``sampling.stop``, built once for every request with
        those stops (else built here, as ``generate`` does)."""
        config = sampling.generation_config(model.generation_config, max_new_tokens)
        if stops is not None:
            config.stop_strings = None
        self.processors = hf_compat.logits_processors(
            model, config, prompt_tokens, extra or LogitsProcessorList()
        )
        config.max_length = prompt_tokens + max_new_tokens  # what generate derives
        self.max_length = config.max_length
        self.stopping = hf_compat.stopping_criteria(
            model,
            config,
            tokenizer,
            StoppingCriteriaList([CancelCriteria(cancel), *([stops] if stops is not None else [])]),
        )
        self.do_sample = bool(config.do_sample)
        self.generator = None
        if sampling.seed is not None:  # the stream a seeded ``generate`` would draw from
            self.generator = torch.Generator(device=model.device).manual_seed(sampling.seed)
        self._ids = torch.zeros((1, self.max_length + 1), dtype=torch.long, device=model.device)
        self._seen: list[int] = []  # what ``_ids`` holds, as a list

    def verify(
        self, tokens: list[int], logits: torch.Tensor, draft: list[int]
    ) -> tuple[list[int], int]:
        """The tokens that follow ``tokens``, given ``logits[j]`` after ``tokens`` and the
        draft's first ``j`` tokens: the longest prefix of the draft this sampler agrees
        with, then a token of its own (fewer where the request finishes); and how many
        draft tokens were kept (no draft: the next token alone). Greedy: a draft token is
        kept when it is the argmax. Sampling (speculative acceptance of a deterministic
        draft): kept with its probability, else the token is drawn from the distribution
        without it, so every token keeps the distribution it is drawn from undrafted."""
        out: list[int] = []
        kept = 0
        for j in range(len(draft) + 1):
            scores = self._scores(tokens + out, logits[j])
            token, agreed = self._judge(scores, draft[j] if j < len(draft) else None)
            out.append(token)
            kept += agreed
            if not agreed or self.finished(tokens + out):
                break
        return out, kept

    def input_ids(self, tokens: list[int]) -> torch.Tensor:
        """``tokens`` as the ``[1, n]`` ids the processors and stopping criteria read. A
        request's tokens only grow, so one tensor is kept and extended in place: building
        ~1,000 ids anew took ~120 us, twice a position per row (2-core EPYC). Tokens that
        do not extend what it holds are written anew."""
        seen, count = self._seen, len(tokens)
        start = len(seen)
        if count < start or tokens[:start] != seen:
            seen.clear()
            start = 0
        if count > self._ids.shape[1]:  # ``max_length`` bounds a request: only for callers
            grown = self._ids.new_zeros((1, 2 * count))
            grown[:, :start] = self._ids[:, :start]
            self._ids = grown
        if count > start:
            self._ids[0, start:count] = torch.tensor(tokens[start:], dtype=torch.long)
            seen.extend(tokens[start:])
        return self._ids[:, :count]

    def _judge(self, scores: torch.Tensor, proposed: int | None) -> tuple[int, bool]:
        if not self.do_sample:
            token = int(scores.argmax())
            return token, token == proposed
        probs = torch.softmax(scores, dim=-1)[0]
        if proposed is not None:
            if float(torch.rand(1, generator=self.generator)) < float(probs[proposed]):
                return proposed, True
            probs = probs.clone()
            probs[proposed] = 0.0
        return int(torch.multinomial(probs, 1, generator=self.generator)), False

    def _scores(self, tokens: list[int], logits: torch.Tensor) -> torch.Tensor:
        scores = logits[None]
        if len(self.processors):
            scores = self.processors(self.input_ids(tokens), scores)  # type: ignore[arg-type]
        return scores

    def finished(self, tokens: list[int]) -> bool:
        """Whether the request ends after ``tokens`` (its last token included)."""
        return bool(self.stopping(self.input_ids(tokens), None).any())  # type: ignore[arg-type]
