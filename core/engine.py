"""The engine: a model, its tokenizer and the KV caches that make repeated context cheap.

One request, top to bottom (``_submit``): validate and tokenize (``prompt/``), look up what
the caches hold (``Caches.look_up``: tier reads, on the caller's thread), plan on that
(``Lookup.plan``, pure), then hand a ``Request`` to the model's executor, which builds its
context in a KV row, computes what is left, decodes and ends it (``generation/``). What the
answer leaves behind is stored off the request path (``Caches.remember``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from typing_extensions import Unpack

from kvboost_rag.core.config import KVBoostConfig
from kvboost_rag.core.generation.handle import ModelHandle
from kvboost_rag.core.generation.options import ChatOptions, TextOptions, split_options
from kvboost_rag.core.generation.sampling import SamplingOptions
from kvboost_rag.core.generation.streaming import GenerationStream
from kvboost_rag.core.inspection import Inspection
from kvboost_rag.core.model import measurements
from kvboost_rag.core.model.loading import (
    check_device,
    check_dtype,
    check_model_kwargs,
    default_cache_root,
    default_dtype,
    gguf_source,
    resolve_model_path,
)
from kvboost_rag.core.model.quantized import check_weights
from kvboost_rag.core.model.stored_weights import kind_of, load_stored
from kvboost_rag.core.prompt.chunker import TokenizedPrompt
from kvboost_rag.core.prompt.prompts import Message, PromptEncoder
from kvboost_rag.core.requests import Requests
from kvboost_rag.core.results import EngineStats, GenerationResult, WarmResult
from kvboost_rag.core.retry import Opened, answered, streamed
from kvboost_rag.core.reuse.caches import Caches
from kvboost_rag.core.store.fingerprint import model_fingerprint
from kvboost_rag.core.store.tiers import open_tiers
from kvboost_rag.core.tools.formats import Tool
from kvboost_rag.core.tools.repeats import RepeatGuard, answered_calls
from kvboost_rag.core.tools.structure import ResponseFormat, Structure
from kvboost_rag.core.warming import Warmer


class KVBoost:
    """A model, its tokenizer and KV caches. Safe to share between threads: every request
    runs on the model's executor (one per model object, shared by the engines wrapping it),
    which decodes concurrent requests together; each answer equals what it gives alone."""

    def __init__(self, model: Any, tokenizer: Any, config: KVBoostConfig | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or KVBoostConfig()
        # What integrations report as the model's name; from_pretrained sets what was asked.
        self.name = str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
        self.fingerprint = model_fingerprint(model, tokenizer)
        folder = measurements.default_folder() if self.config.remember_measurements else None
        measured = measurements.Measurements(folder, self.fingerprint.hex())
        self._handle = ModelHandle.of(model, measured)
        self.support = self._handle.support
        self.context_window = self._handle.context_window
        self._prompts = PromptEncoder(
            tokenizer,
            self.context_window,
            self.config.max_passage_tokens,
            self.config.tool_result_notes,
        )
        self._store = open_tiers(self.config, self.fingerprint)
        self._caches = Caches(
            self._handle.engine_model,
            self.support,
            self.config,
            self._store,
            self.fingerprint,
            self._prompts.special_prefix,
            tokenizer,
            self._handle.executor.arriving,
        )
        self._warmer = Warmer(
            self._handle.engine_model,
            self.config,
            self.support,
            self._prompts,
            self._caches,
            self._handle.executor,
        )
        self._requests = Requests(
            self._handle, tokenizer, self.config, self._caches, self._prompts.written
        )
        executor = self._handle.executor
        executor.warm_up(self.config.packed_head, self.config.packed_linears, measured)
        executor.compile_step(self.config.compiled_step)
        self._handle.executor.hand_over()  # the pool that loaded the model (openmp.py)

    @property
    def inspect(self) -> Inspection:
        """What the engine made of a prompt and what its caches hold, for measuring and
        debugging (``core/inspection.py``); serving never needs it."""
        return Inspection(self._prompts, self._caches, self._store, self._handle)

    @classmethod
    def from_pretrained(
        cls,
        model: str = "smollm2-135m-instruct",
        *,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        weights: str | None = None,
        config: KVBoostConfig | None = None,
        **model_kwargs: Any,
    ) -> KVBoost:
        """Load an embedded alias (``"smollm2-135m-instruct"``, ``"qwen2.5-coder-1.5b-instruct"``:
        ``kvboost-rag models`` lists them), a model folder, a GGUF file (converted once into
        the cache, ``gguf_file=`` as transformers takes it) or an HF id.

        ``dtype``: "float32", "bfloat16", "float16" or a torch dtype (None: bf16 where the
        hardware computes it, else fp32). ``device``: e.g. "cpu", "cuda" (None: CUDA when
        available). ``weights``: how the linear layers' weights are stored: "dense", the
        checkpoint's float weights; "gguf", a GGUF's (or an alias's) own 4- or 8-bit blocks on
        a CPU that runs their kernel (``model/blocks.py``); None, the file decides (a GGUF in
        formats measured to keep answers: its blocks, ``quantized.weights_for``); "int8",
        "int4", "int8-dynamic" quantize float weights (CPU only; ``model/quantized.py``).
        ``config``: how the engine caches (``KVBoostConfig``). Other keyword arguments go to
        transformers' ``from_pretrained`` (``device_map``, ``attn_implementation``, ...).
        Every argument is checked before anything loads: ``UnknownModelError`` for a model
        that is not there, ``ValueError`` / ``TypeError`` for the others."""
        check_model_kwargs(model_kwargs)
        if config is not None and not isinstance(config, KVBoostConfig):
            raise TypeError(f"config must be a KVBoostConfig, got {type(config).__name__}")
        dev = check_device(device)
        chosen = check_dtype(dtype) or default_dtype(dev)
        checked = check_weights(weights, dev)
        gguf_file = model_kwargs.pop("gguf_file", None)
        path = resolve_model_path(model, gguf_file=gguf_file)
        source = gguf_source(model, gguf_file=gguf_file)
        kind = kind_of(checked, path, source, dev, chosen, model_kwargs)
        hf_model, tokenizer = load_stored(
            path, chosen, dev, kind, source, default_cache_root(), **model_kwargs
        )
        engine = cls(hf_model, tokenizer, config)
        engine.name = model
        return engine

    @staticmethod
    def of(target: Any) -> KVBoost:
        """``target`` if it is an engine, else the engine it holds as ``.engine`` (the
        package's LangChain and LlamaIndex classes). Raises ``TypeError`` otherwise."""
        engine = target if isinstance(target, KVBoost) else getattr(target, "engine", None)
        if not isinstance(engine, KVBoost):
            raise TypeError(
                "expected a KVBoost engine or an object holding one as .engine (ChatKVBoost, "
                f"KVBoostPipeline, KVBoostLLM), got {type(target).__name__}"
            )
        return engine

    # -- requests ----------------------------------------------------------------------

    def generate(self, prompt: str, **options: Unpack[TextOptions]) -> GenerationResult:
        """Complete ``prompt``. Passages may be marked inside it with ``passage(text)`` or
        given as ``passages=`` (placed before it). Options: max_new_tokens, temperature,
        top_p, top_k, stop, seed, draft_tokens (``SamplingOptions``);
        ``response_format`` / ``constrain`` as in ``chat``."""
        return self._requests.open(*self._text(prompt, options)[:4]).wait()

    def chat(self, messages: Sequence[Message], **options: Unpack[ChatOptions]) -> GenerationResult:
        """Answer the last message of a conversation, using the tokenizer's chat template.

        ``tools`` (OpenAI-style dicts) are offered to the model; its calls come back in
        ``result.tool_calls`` and ``result.text`` holds the rest. ``tool_choice``: "auto",
        "required", "none" or a tool's name; one call per answer unless
        ``parallel_tool_calls``. ``response_format`` (``{"type": "json_object"}`` or
        ``{"type": "json_schema", "json_schema": {"schema": ...}}``) asks for JSON. Both
        decode under a grammar unless ``constrain=False`` (default:
        ``config.constrained_decoding``). Messages may carry ``tool_calls`` (assistant)
        and be ``{"role": "tool", "content", "tool_call_id"}`` results.
        ``repeat_guard`` (default True): a call equal to one the messages already hold
        with its result is withheld (``result.withheld_tool_calls``) and the answer
        decoded again as text; False returns it (polling a tool can be legitimate). An
        answer that offered tools and came back empty is decoded again as text too
        (``result.retried`` says why). Sampling options as in ``generate``."""
        return answered(self._requests, *self._chat(messages, options))

    def stream(self, prompt: str, **options: Unpack[TextOptions]) -> GenerationStream:
        """Like ``generate`` but yields text deltas; ``.result`` is set when it ends."""
        return streamed(self._requests, *self._text(prompt, options))

    def stream_chat(
        self, messages: Sequence[Message], **options: Unpack[ChatOptions]
    ) -> GenerationStream:
        """Like ``chat`` but yields content deltas (a tool call being written is held
        back); ``.result``, with the calls, is set when it ends. A retry (``chat``'s
        ``repeat_guard``) streams on after what was shown."""
        return streamed(self._requests, *self._chat(messages, options))

    def first_token_logits(
        self, prompt: str | Sequence[Message], *, passages: Sequence[str] | None = None
    ) -> torch.Tensor:
        """Next-token logits after ``prompt`` (text, or chat messages), computed on the same
        cached path as ``generate`` / ``chat``, for fidelity checks against a full prefill.
        Stores no prefix; passages it encodes are cached, as in ``generate``."""
        return self._logits(self._tokenized(prompt, passages), [])[0]

    def answer_logits(
        self,
        prompt: str | Sequence[Message],
        answer_ids: Sequence[int],
        *,
        passages: Sequence[str] | None = None,
    ) -> torch.Tensor:
        """``[len(answer_ids), vocab]`` float32 logits predicting each answer token, fed
        the answer before it (teacher forcing), on the same cached path as ``generate``:
        to compare a whole answer's distributions with a full prefill's."""
        if not answer_ids:
            raise ValueError("answer_ids is empty: pass the answer's token ids")
        return self._logits(self._tokenized(prompt, passages), list(answer_ids[:-1]))

    def structure(
        self,
        tools: Sequence[Tool] | None = None,
        tool_choice: str = "auto",
        parallel_tool_calls: bool = False,
        response_format: ResponseFormat | None = None,
        constrain: bool | None = None,
    ) -> Structure:
        """What a request asks of the answer's form, validated (``ValueError``)."""
        return Structure(
            tuple(tools or ()),
            tool_choice,
            response_format,
            self.config.constrained_decoding if constrain is None else constrain,
            self._prompts.tool_format(self.config.tool_format),
            parallel_tool_calls,
        )

    def tokenize(self, prompt: str, *, passages: Sequence[str] | None = None) -> list[int]:
        """The exact token ids the model sees for ``prompt`` (markers removed)."""
        return self._prompts.text(prompt, passages).tokens

    def tokenize_chat(
        self, messages: Sequence[Message], *, tools: Sequence[Tool] | None = None
    ) -> list[int]:
        """The exact token ids the model sees for ``messages`` and ``tools`` (markers
        removed)."""
        structure = self.structure(tools)
        return self._prompts.chat(messages, structure.tools, structure.fmt).tokens

    # -- warming -----------------------------------------------------------------------

    def warm(self, text: str) -> WarmResult:
        """Prefill ``text`` and cache it as an exact prefix of later prompts."""
        return self._warmer.warm(text)

    def warm_passages(
        self,
        texts: Sequence[str] | str,
        *,
        prefix: str | Sequence[Message] | None = None,
        batch_size: int | None = None,
        progress: Callable[[int], None] | None = None,
        names: Sequence[str] | None = None,
    ) -> WarmResult:
        return self._warmer.warm_passages(
            texts, prefix=prefix, batch_size=batch_size, progress=progress, names=names
        )

    warm_passages.__doc__ = Warmer.warm_passages.__doc__

    def passage_prefix(self, prefix: str | Sequence[Message] | None) -> list[int]:
        return self._warmer.passage_prefix(prefix)

    passage_prefix.__doc__ = Warmer.passage_prefix.__doc__

    # -- the engine's state ------------------------------------------------------------

    def stats(self) -> EngineStats:
        """A snapshot; it does not wait for requests in flight (the tiers lock their own)."""
        tiers = self._store.stats()
        batch = self._handle.executor.stats()
        return EngineStats(tiers.memory, tiers.disk, *self._requests.counts(), tiers.remote, batch)

    def flush(self) -> None:
        """Wait until what finished requests left behind is stored: index updates, encodes
        deferred after an answer, queued disk and shared-tier writes (``warm_passages`` /
        ``warm_corpus`` already wait). Raises ``OSError`` for a disk write that failed;
        shared-tier failures are warnings."""
        self._caches.indexer.join()
        self._handle.executor.drain()
        self._caches.indexer.join()
        self._store.flush()

    def clear_cache(self) -> None:
        """Empty the memory tier; the disk and shared tiers are persistent by design. What
        finished requests left behind (index updates, encodes deferred after an answer)
        lands first, so none of it refills the memory tier once it is emptied."""
        self._caches.indexer.join()
        self._handle.executor.drain()
        self._caches.indexer.join()
        self._store.clear()

    # -- the request path --------------------------------------------------------------

    def _text(self, prompt: str, options: TextOptions) -> Opened:
        """A text request: its prompt, sampling options, structure and start time (and no
        repeat guard)."""
        start = time.perf_counter()
        given, form = split_options(dict(options), TextOptions)
        passages = form.pop("passages", None)
        sampling, structure = self._checked(given, **form)
        return self._prompts.text(prompt, passages), sampling, structure, start, None

    def _chat(self, messages: Sequence[Message], options: ChatOptions) -> Opened:
        """A chat request: its prompt, sampling options, structure and start time, and the
        repeat guard over its messages (None when off or nothing to guard)."""
        start = time.perf_counter()
        given, form = split_options(dict(options), ChatOptions)
        guarded = form.pop("repeat_guard", True)
        if not isinstance(guarded, bool):
            raise ValueError(f"repeat_guard must be True or False, got {guarded!r}")
        sampling, structure = self._checked(given, **form)
        prompt = self._prompts.chat(messages, structure.tools, structure.fmt)
        done = answered_calls(messages) if guarded and structure.calls_parsed else None
        guard = RepeatGuard(done) if done else None
        return prompt, sampling, structure, start, guard

    def _checked(self, given: dict[str, Any], **form: Any) -> tuple[SamplingOptions, Structure]:
        sampling = SamplingOptions.build(**given)
        self._requests.check_stops(sampling.stop)
        return sampling, self.structure(**form)

    def _tokenized(
        self, prompt: str | Sequence[Message], passages: Sequence[str] | None
    ) -> TokenizedPrompt:
        if isinstance(prompt, str):
            return self._prompts.text(prompt, passages)
        return self._prompts.chat(prompt)

    def _logits(self, prompt: TokenizedPrompt, more: list[int]) -> torch.Tensor:
        """Logits after the prompt and after each token of ``more`` fed behind it."""
        sampling = SamplingOptions(max_new_tokens=1)
        request = self._requests.open(prompt, sampling, Structure(), time.perf_counter(), feed=more)
        request.wait()
        assert request.logits is not None
        return request.logits
