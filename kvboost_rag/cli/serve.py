"""``kvboost-rag serve [MODEL]``: load one engine and serve it over OpenAI's HTTP API.

Its flags are checked before the model loads (bad usage: one line, exit status 2); the
server itself (FastAPI, uvicorn) is imported only when it starts, so the rest of the CLI
works without the ``serve`` extra."""

from __future__ import annotations

import argparse
import os
from typing import Any

from kvboost_rag.cli.arguments import (
    BadUsage,
    CommandFailed,
    add_weights,
    at_least,
    between,
    cache_folder,
    dtype_name,
    positive,
)
from kvboost_rag.core.config import FIDELITY_LEVELS

API_KEY_VARIABLE = "KVBOOST_API_KEY"  # --api-key's default, so the key stays off `ps`


def serve(args: argparse.Namespace) -> None:
    from kvboost_rag import KVBoost, KVBoostConfig

    server = _server_module()  # before anything else: the settings live in that package
    settings = _settings(args)
    config = KVBoostConfig(
        fidelity=args.fidelity, cache_dir=args.cache_dir, remote_url=args.remote_url
    )
    engine = KVBoost.from_pretrained(
        args.model, dtype=args.dtype, device=args.device, weights=args.weights, config=config
    )
    server.run(engine, settings, log_level=args.log_level)


def _settings(args: argparse.Namespace) -> Any:
    """The server's settings; a limit not given keeps ``ServeSettings``' default (the one
    place defaults are stated)."""
    from kvboost_rag.serve.settings import ServeSettings

    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_VARIABLE)
    limits = {
        "max_body_bytes": args.max_body_bytes,
        "max_queue": args.max_queue,
        "max_answers": args.max_answers,
        "request_timeout_s": args.request_timeout,
    }
    try:
        return ServeSettings(
            model_name=args.model if args.served_model_name is None else args.served_model_name,
            host=args.host,
            port=args.port,
            api_key=key or None,
            **{name: value for name, value in limits.items() if value is not None},
        )
    except ValueError as error:
        raise BadUsage(str(error)) from None


def _server_module() -> Any:
    try:
        import kvboost_rag.serve as server
    except ImportError as error:  # the install hint, on one line
        raise CommandFailed(str(error)) from None
    return server


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def add_parser(sub: Any) -> None:
    s = sub.add_parser(
        "serve",
        help="serve a model over OpenAI's HTTP API (chat, completions, models, health)",
        description="Load MODEL once and serve it over an OpenAI-compatible API at "
        "http://HOST:PORT/v1, for the openai client, LangChain's ChatOpenAI and LlamaIndex's "
        f"OpenAILike. Requests need 'Authorization: Bearer KEY' when --api-key or "
        f"${API_KEY_VARIABLE} gives a key. Stop with Ctrl-C: requests in flight finish first.",
    )
    s.add_argument(
        "model",
        nargs="?",
        default="smollm2-135m-instruct",
        help="an embedded alias (kvboost-rag models), a model folder, a GGUF file or an HF id",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    s.add_argument("--port", type=between(1, 65535), default=8000)
    s.add_argument("--api-key", help=f"require this Bearer key (default: ${API_KEY_VARIABLE})")
    s.add_argument("--served-model-name", help="the model name clients pass (default: MODEL)")
    s.add_argument("--dtype", type=dtype_name, help="float32 or bfloat16 (default: auto)")
    s.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: CUDA when available)")
    add_weights(s)
    s.add_argument("--fidelity", default="balanced", choices=list(FIDELITY_LEVELS))
    s.add_argument("--cache-dir", type=cache_folder, help="the disk tier of passage KV")
    s.add_argument("--remote-url", help="the shared tier: redis://host:6379/0")
    s.add_argument("--max-queue", type=positive, help="requests in flight before 429")
    s.add_argument(
        "--max-answers", type=positive, help="answers a request may ask for (prompts x n)"
    )
    s.add_argument("--max-body-bytes", type=at_least(1), help="larger bodies get 413")
    s.add_argument("--request-timeout", type=_seconds, help="seconds before a request gets 504")
    s.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    s.set_defaults(func=serve)
