"""What every engine on one model shares: the engine's own copy of the model (``view.py``),
its structure and the executor that runs it, so requests from several engines on one model
decode together and never interleave forwards. Held here, in one registry keyed by the
model object (weakly), instead of as attributes set on the user's model.

The registry holds handles weakly, keyed by the model's ``id``: a handle keeps its model
alive, so the id cannot be reused while the entry exists, and the entry goes with the last
engine holding the handle."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from kvboost_rag.core.generation.executor import Executor
from kvboost_rag.core.generation.profile import SpeedProfile
from kvboost_rag.core.model.arch import ModelSupport, copy_support, model_support
from kvboost_rag.core.model.measurements import FORGETFUL, Measurements
from kvboost_rag.core.model.view import engine_view


@dataclass(eq=False)
class ModelHandle:
    model: Any  # the user's, as they left it
    engine_model: Any  # the copy every engine forward runs (``engine_view``)
    support: ModelSupport  # the engine model's structure
    eos: frozenset[int]  # token ids that end an answer (the generation config's)
    executor: Executor = field(repr=False)

    @property
    def device(self) -> torch.device:
        return torch.device(self.model.device)

    @property
    def context_window(self) -> int:
        return int(self.model.config.max_position_embeddings)

    def profile(self) -> SpeedProfile:
        """What makes this model's forwards fast, as the engine chose it (``profile.py``)."""
        from kvboost_rag.core.generation.profile import speed_profile

        return speed_profile(self.executor.batch)

    @classmethod
    def of(cls, model: Any, measurements: Measurements = FORGETFUL) -> ModelHandle:
        """The handle of ``model``, made on first use (thread-safe); its structure's probe
        is recalled from ``measurements`` where this machine made it before."""
        with _GUARD:
            handle = _HANDLES.get(id(model))
            if handle is None or handle.model is not model:
                handle = _make(model, measurements)
                _HANDLES[id(model)] = handle
            return handle


def eos_ids(model: Any) -> frozenset[int]:
    eos = model.generation_config.eos_token_id
    return frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])


def _make(model: Any, measurements: Measurements) -> ModelHandle:
    support = model_support(model, measurements)  # refuses a model before copying it
    view = engine_view(model)
    support = copy_support(view, support)
    return ModelHandle(model, view, support, eos_ids(model), Executor(view, support))


_GUARD = threading.Lock()
_HANDLES: weakref.WeakValueDictionary[int, ModelHandle] = weakref.WeakValueDictionary()
