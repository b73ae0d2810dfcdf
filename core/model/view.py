"""The engine's own copy of a model: the user's modules copied, every weight shared.

The engine's forwards compute differently from transformers' (the linear layers' way per
row count, ``linears.py``; attention split at a cached prefix or as few-query products,
``attention.py``). Those choices live in modules of this copy, never in the user's: the
user's model keeps its classes, its attention implementation and its config, so
``model.generate`` and every other caller see it exactly as they left it. The copy shares
every parameter, buffer and other tensor the user's modules hold (no bytes of weights are
copied), so a weight changed in place is seen by both; modules added to the user's model
afterwards (an adapter) are not.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from kvboost_rag.core.model import attention, linears


def engine_view(model: Any) -> Any:
    """A copy of ``model`` over the same tensors, with the engine's linear layers (on a CPU)
    and its attention (where the model runs SDPA)."""
    shared: dict[int, Any] = {}
    for module in model.modules():
        tensors = (*module._parameters.values(), *module._buffers.values(), *vars(module).values())
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                shared[id(tensor)] = tensor
    view = copy.deepcopy(model, memo=shared)
    linears.install(view)
    attention.install(view)
    return view
