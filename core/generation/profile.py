"""The speed profile of one model on one device: what makes the engine's forwards fast.

Every choice below changes how fast a forward runs, never its answer beyond rounding. Each
is made once per model (measured when its first engine warms up, or recalled from an
earlier start on this machine) and steers the forwards through one explicit channel:

- the linear layers' way per row count (plain, transposed, packed): measured by
  ``linears.measure``; each ``EngineLinear`` reads its table (``linears.adopt``);
- packed copies of the linear weights: kept once an engine's ``packed_linears`` allows
  them (``linears.adopt``);
- int8 / int4 / int8-dynamic weights: ``from_pretrained(weights=)``; the model's
  ``QuantizedLinear``s;
- the packed head: ``PackedHead``'s check; ``Runner.run_rows`` applies it;
- attention split at a cached prefix, few-query decoding steps: the ``Runner`` says so per
  forward in an ``attention.Forward``, passed as the model call's ``kvboost`` keyword;
- the compiled one-row step: ``CompiledStep.prepare``; ``Runner.run_rows`` takes it;
- which drafts a step feeds: ``Drafting`` (the compiled step, the quantized rows' cost);
  ``Batch._decode`` asks it.

The engine's forwards run on its own copy of the model (``model/view.py``), so none of it
touches the user's model. ``speed_profile`` reads the choices back as made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvboost_rag.core.model import linears
from kvboost_rag.core.model.attention import steered
from kvboost_rag.core.model.blocks import BlockLinear
from kvboost_rag.core.model.footprint import step_bytes
from kvboost_rag.core.model.hf_compat import attention_implementation
from kvboost_rag.core.model.quantized import QuantizedLinear
from kvboost_rag.core.model.torch_compat import cpu_flash_attention

if TYPE_CHECKING:
    from kvboost_rag.core.generation.batch import Batch


@dataclass(frozen=True)
class SpeedProfile:
    device: str
    dtype: str
    weights: str  # "checkpoint", or the quantized kind (``quantized.WEIGHTS``)
    linear_ways: dict[int, str]  # measured row count -> way, where not F.linear
    packed_linears: bool  # whether packed copies are kept and taken
    packed_head: str  # "packed", "model's head", or "not checked yet"
    attention: str  # the engine model's attention, and what its forwards may take
    compiled_step: str  # "on", "off", or "eager: why"
    drafts: str  # the rule a lone row's drafts follow
    step_bytes: int  # weights' bytes a one-row step reads (``footprint.step_bytes``)


def speed_profile(batch: Batch) -> SpeedProfile:
    """The choices ``batch``'s forwards take now (``Batch`` of the model's executor)."""
    runner = batch.runner
    model = runner.model
    layers = linears.engine_layers(model)
    table = layers[0].table if layers else ()
    ways = {n: table[n] for n in linears.CANDIDATES if table and table[n] != linears.PLAIN}
    kinds = {m.kind for m in model.modules() if isinstance(m, (QuantizedLinear, BlockLinear))}
    correct, faster = runner.head._correct, runner.head._faster
    head = (
        "not checked yet" if correct is None else "packed" if correct and faster else "model's head"
    )
    if steered(model):
        split = "split at a cached prefix" if cpu_flash_attention() is not None else "no split"
        attention = f"kvboost_sdpa ({split}; few-query decoding steps)"
    else:
        attention = str(attention_implementation(model))
    rule = "a lone row feeds every draft"
    if batch.drafting.row_cost is not None:
        rule = "a lone row feeds a draft while it pays for the quantized rows' cost"
    elif runner.compiled.usable:
        rule = "a lone row feeds a draft while it pays for leaving the compiled step"
    return SpeedProfile(
        device=str(torch.device(model.device)),
        dtype=str(model.dtype).replace("torch.", ""),
        weights=",".join(sorted(kinds)) or "checkpoint",
        linear_ways=ways,
        packed_linears=linears.PACKED in ways.values(),
        packed_head=head,
        attention=attention,
        compiled_step=runner.compiled.state,
        drafts=rule,
        step_bytes=step_bytes(model),
    )
