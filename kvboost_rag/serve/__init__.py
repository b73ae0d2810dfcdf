"""``kvboost-rag serve``: an OpenAI-compatible HTTP server over one engine, so clients that
speak OpenAI's API (the ``openai`` package, LangChain's ``ChatOpenAI``, LlamaIndex's
``OpenAILike``) get the engine's passage reuse without loading a model themselves.

Install with ``pip install 'kvboost-rag[serve]'``.
"""

from kvboost_rag.integrations._common import require

require("fastapi", "serve")
require("uvicorn", "serve")
require("prometheus_client", "serve")

from kvboost_rag.serve.app import create_app  # noqa: E402
from kvboost_rag.serve.server import run, serving  # noqa: E402
from kvboost_rag.serve.settings import ServeSettings  # noqa: E402

__all__ = ["ServeSettings", "create_app", "run", "serving"]
