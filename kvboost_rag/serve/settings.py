"""How ``kvboost-rag serve`` listens and what it admits: one frozen value, checked when built."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ServeSettings"]


@dataclass(frozen=True)
class ServeSettings:
    """What the server binds to and the limits it holds every request to.

    Raises ``ValueError`` for a value out of range; the CLI builds one from its flags.
    """

    # The name clients pass as ``model`` (and /v1/models lists); other names get 404.
    model_name: str = "smollm2-135m-instruct"
    # Loopback by default: the server has no TLS, and an API key is off unless given.
    host: str = "127.0.0.1"
    port: int = 8000
    # When set, every /v1 request needs ``Authorization: Bearer <api_key>``.
    api_key: str | None = None
    # Bodies above this are refused (413) before any of them is parsed.
    max_body_bytes: int = 4 * 2**20
    # Requests in flight at once (decoding or waiting for the model); more get 429.
    max_queue: int = 64
    # Answers one request may ask for, its prompts times ``n`` (each is a stream decoding on
    # the model); more are refused with 400. A prompt list of 1,000 with ``n: 16`` opened
    # 16,000 streams as one request against ``max_queue``. OpenAI's own ``n`` stops at 128.
    max_answers: int = 128
    # A request that has not finished after this long is cancelled (504).
    request_timeout_s: float = 600.0
    # What a 429 tells the client to wait, in seconds (its Retry-After header).
    retry_after_s: int = 1
    # How long shutdown waits for requests in flight before it cancels them.
    shutdown_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name is empty: pass the name clients send as `model`")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is blank: pass a key, or None for no authentication")
        for name in ("max_body_bytes", "max_queue", "max_answers", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("request_timeout_s", "shutdown_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
