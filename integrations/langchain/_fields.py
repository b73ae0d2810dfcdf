"""The fields and request plumbing ``KVBoostPipeline`` and ``ChatKVBoost`` share."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from pydantic import ConfigDict, Field, model_validator

from kvboost_rag.core.config import Fidelity, KVBoostConfig
from kvboost_rag.core.engine import KVBoost
from kvboost_rag.core.model.quantized import Weights
from kvboost_rag.core.results import GenerationResult
from kvboost_rag.integrations._common import (
    DEFAULT_MODEL,
    SAMPLING_OPTIONS,
    SamplingFields,
    check_engine_fidelity,
    load_engine,
    result_stats,
)
from kvboost_rag.integrations.langchain.tools import engine_tools

# What any call may pass through ``invoke(..., **kwargs)`` or ``bind(**kwargs)`` (``stop``
# comes as LangChain's own argument).
CALL_OPTIONS = frozenset(SAMPLING_OPTIONS) - {"stop"} | {"documents"}
# The answer's form, passed on to the engine: ``generate`` and ``chat`` take these ...
FORM_OPTIONS: tuple[str, ...] = ("response_format", "constrain")
# ... and ``chat`` these (``ChatKVBoost`` only).
TOOL_OPTIONS: tuple[str, ...] = ("tools", "tool_choice", "parallel_tool_calls", "repeat_guard")
# Fields that only describe how to load a model: meaningless beside a given engine.
LOAD_FIELDS = ("model_id", "dtype", "device", "weights", "config")


class KVBoostFields(SamplingFields):
    """Model, sampling and reuse settings; every field is used, none is decorative."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    _ls_model_type: ClassVar[str] = "chat"  # LangSmith's model type: "chat" or "llm"
    _form_options: ClassVar[tuple[str, ...]] = FORM_OPTIONS  # engine options beyond sampling

    # strict, as the sampling fields: pydantic would otherwise read b"cpu" as "cpu".
    model_id: str = Field(
        default=DEFAULT_MODEL,
        strict=True,
        description="Embedded alias, local folder or HF id to load (no downloads happen "
        "when the weights are local). Taken from the engine when one is given.",
    )
    engine: KVBoost | None = Field(
        default=None,
        exclude=True,
        description="An existing KVBoost engine to wrap, so several LangChain objects share "
        "one model and one KV cache. Built from the other fields when not given.",
    )
    dtype: str | None = Field(
        default=None,
        strict=True,
        description="torch dtype to load in ('float32', 'bfloat16'); auto if None.",
    )
    device: str | None = Field(
        default=None, strict=True, description="Device to load on; auto if None."
    )
    weights: Weights | None = Field(
        default=None,
        description="Store the linear weights quantized (CPU); the checkpoint's if None.",
    )
    config: KVBoostConfig | None = Field(
        default=None, exclude=True, description="Engine configuration used when loading."
    )
    fidelity: Fidelity | None = Field(
        default=None,
        description="Passage-reuse fidelity level; None keeps the engine's (default "
        "'balanced'). Must match a wrapped engine's level.",
    )
    streaming: bool = Field(
        default=False, description="Generate through the streaming path (token callbacks)."
    )

    def __init__(self, **fields: Any) -> None:
        super().__init__(**fields)
        if self.engine is None:
            # Loaded once the fields are valid, outside pydantic's validators, which would
            # wrap the loader's specific errors (UnknownModelError, ...) in a ValidationError.
            self.engine = load_engine(
                self.model_id,
                fidelity=self.fidelity,
                dtype=self.dtype,
                device=self.device,
                weights=self.weights,
                config=self.config,
            )

    @model_validator(mode="after")
    def _attach_engine(self) -> KVBoostFields:
        self.engine_options()  # validates the sampling fields together
        if self.engine is None:
            return self  # loaded by __init__
        given = [name for name in LOAD_FIELDS if name in self.model_fields_set]
        if given:
            raise ValueError(
                f"{', '.join(given)} describe(s) how to load a model; pass them or "
                "engine=, not both"
            )
        check_engine_fidelity(self.engine, self.fidelity)
        self.model_id = getattr(self.engine, "name", None) or self.model_id
        return self

    @classmethod
    def from_model_id(cls, model_id: str = DEFAULT_MODEL, **kwargs: Any) -> Any:
        """Load ``model_id`` (an embedded alias, a local folder or an HF id)."""
        return cls(model_id=model_id, **kwargs)

    @property
    def kv_engine(self) -> KVBoost:
        assert self.engine is not None  # set by the validator
        return self.engine

    def _request(
        self, stop: Sequence[str] | None, kwargs: dict[str, Any]
    ) -> tuple[dict[str, Any], list[Any]]:
        """The engine options for one call, and the documents it passed (if any)."""
        self._check_options(kwargs)
        model = kwargs.get("model")
        if model is not None and model != self.model_id:
            raise ValueError(
                f"this object serves {self.model_id!r}; it cannot switch to {model!r} per call"
            )
        overrides = {k: kwargs[k] for k in CALL_OPTIONS - {"documents"} if k in kwargs}
        options = self.engine_options({**overrides, "stop": stop})
        form = {k: kwargs[k] for k in self._form_options if kwargs.get(k) is not None}
        if "tools" in form or "tool_choice" in form:
            form.update(engine_tools(form.get("tools"), form.get("tool_choice")))
        return {**options, **form}, _documents(kwargs.get("documents"))

    def _check_options(self, kwargs: dict[str, Any]) -> None:
        accepted = CALL_OPTIONS | set(self._form_options)
        unknown = set(kwargs) - accepted - {"model"}
        if unknown & set(TOOL_OPTIONS):
            raise TypeError(
                f"{type(self).__name__} completes text and cannot call tools; use ChatKVBoost "
                "for tools"
            )
        if unknown:
            raise TypeError(
                f"unknown option(s) {sorted(unknown)}; a call accepts {sorted(accepted)}"
            )

    def _stats(self, result: GenerationResult) -> dict[str, Any]:
        return {"model_name": self.model_id, **result_stats(result)}

    # Methods both LangChain base classes define; this class comes first in the MRO.

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_id": self.model_id,
            "fidelity": self.kv_engine.config.fidelity,
            **self.model_dump(include=set(SAMPLING_OPTIONS) - {"stop"}),
        }

    def get_token_ids(self, text: str) -> list[int]:
        """The model's own token ids (LangChain's default would fetch GPT-2's tokenizer)."""
        return list(self.kv_engine.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        params: dict[str, Any] = {
            "ls_provider": "kvboost_rag",
            "ls_model_type": self._ls_model_type,
            "ls_model_name": kwargs.get("model") or self.model_id,
            "ls_temperature": kwargs.get("temperature", self.temperature),
            "ls_max_tokens": kwargs.get("max_tokens", self.max_tokens),
        }
        stops = stop if stop is not None else self.stop
        if isinstance(stops, str):
            stops = [stops]
        if stops and isinstance(stops, (list, tuple)):  # else the call refuses it, clearly
            params["ls_stop"] = list(stops)
        return params


def _documents(documents: Any) -> list[Any]:
    """A call's ``documents=`` as a list; a lone string would otherwise be iterated as one
    document per character."""
    if documents is None:
        return []
    if isinstance(documents, (str, bytes, Mapping)) or not isinstance(documents, Sequence):
        raise TypeError(
            f"documents must be a list of strings, LangChain Documents or LlamaIndex nodes, "
            f"got {type(documents).__name__}"
        )
    return list(documents)
