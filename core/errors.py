"""Exceptions users see. Each one says what was wrong and what to pass instead."""

from __future__ import annotations


class KVBoostError(Exception):
    """Base class of every error kvboost-rag raises on purpose."""


class EmptyPromptError(KVBoostError, ValueError):
    """The prompt (or message list) has no tokens to condition on."""


class ContextWindowError(KVBoostError, ValueError):
    """The prompt does not fit the model's context window."""

    def __init__(
        self,
        prompt_tokens: int,
        context_window: int,
        what: str = "prompt",
        fix: str = "shorten it or retrieve fewer passages",
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.context_window = context_window
        super().__init__(
            f"{what} is {prompt_tokens} tokens but the model's context window is "
            f"{context_window} tokens (at least one token must be left to generate); {fix}"
        )


class UnknownModelError(KVBoostError, ValueError):
    """A model name is neither an embedded alias, a local path nor a usable hub id."""


class UnsupportedModelError(KVBoostError, ValueError):
    """The model's cache is not attention KV that can be reused by position."""
