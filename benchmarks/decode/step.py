"""What one decoding step's parts cost, and whether compiling them pays.

    python -m benchmarks.decode.step [--model M] [--dtype D] [--keys 900] [--rows 1,8]
                           [--parts whole,attention,linears,mlps] [--out DIR]

On the loaded model's own modules, one token per row:

- the whole decoding step over ``--keys`` cached keys: the engine's (``Runner`` on its slot
  cache, the decoder's linear layers the way ``linears.measure`` picks), and transformers'
  forward over a ``StaticCache``, eager and through ``torch.compile`` (inductor, weights
  frozen, C++ wrapper: the compiled step transformers' static cache is made for; its
  ``generate`` does not compile on a CPU) with the model's SDPA and with its eager
  attention (matrix products inductor can fuse), and, for one row, the engine's own row
  compiled the same way (``compiled_row``), with the compile times (not for models with
  sliding-window layers, whose static cache layers count positions apart);
- the MLPs of every layer, eager and through ``torch.compile`` (inductor, weights frozen
  into the graph, the form it prepacks for oneDNN), with the compile time;
- the decoder layers' linear layers, and the lm_head, through ``F.linear``, on weights
  prepacked for oneDNN (``core/model/packed.py``: the engine packs the head) and as
  ``W @ x.T`` (``core/model/linears.py``: the engine's layers over 2-32 rows);
- the attention of every layer over ``--keys`` cached keys: transformers' SDPA path (torch's
  CPU flash kernel; with a mask at several rows, as the executor's batched steps pass one)
  and the engine's ``few_query_attention``, with the largest difference between them.

Prints the table and writes ``step-<dtype>.json``. The decode benchmark
(``bench decode``) measures whole answers; this one says where a step's time goes.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvboost_rag import KVBoost
from kvboost_rag.bench.common.baseline import write_report
from kvboost_rag.bench.common.systems import machine
from kvboost_rag.cli.arguments import ArgumentParser, dtype_name, one_of, positive, positive_list
from kvboost_rag.core.generation.handle import ModelHandle
from kvboost_rag.core.model.arch import model_support
from kvboost_rag.core.model.attention import few_query_attention
from kvboost_rag.core.model.hf_compat import eager_attention
from kvboost_rag.core.model.packed import median_seconds

PARTS = ("whole", "attention", "linears", "mlps")


def timed(fn: Callable[[], object], repeats: int = 30) -> float:
    """Median milliseconds of ``fn`` (after warm-up calls)."""
    return median_seconds(fn, repeats, warmups=3) * 1e3


def whole_step_rows(model: Any, rows: int, keys: int) -> list[dict[str, Any]]:
    """One decoding step of the whole model, ``rows`` rows of one token over ``keys`` cached
    keys each: the engine's, transformers' over a ``StaticCache``, and that compiled."""
    from transformers import StaticCache

    from kvboost_rag.core.generation.batch import Batch

    support = model_support(model)
    if support.sliding_window is not None:  # sliding StaticCache layers keep their own count
        print("whole step: not timed, the model has sliding-window layers")
        return []
    vocab = int(model.config.vocab_size)
    prompt = torch.randint(0, vocab, (rows, keys), generator=torch.Generator().manual_seed(0))
    token = prompt[:, :1]
    handle = ModelHandle.of(model)  # the engine's own model: its linears and attention
    runner = Batch(handle.engine_model, handle.support).runner
    runner.warm_up(0, None, packed_linears=True)
    runner.slots.reserve(rows, keys + 1)
    everyone = list(range(rows))
    runner.run_rows(everyone, prompt.tolist(), [range(keys)] * rows)
    # the same position every time: the step's width stays ``keys + 1``
    engine = functools.partial(runner.run_rows, everyone, token.tolist(), [[keys]] * rows)
    ours = [timed(engine)]

    cache = StaticCache(config=model.config, max_cache_len=keys + 1)
    model(input_ids=prompt, cache=cache)
    forward = static_step(cache, keys, {"input_ids": token})
    want = forward(model)

    def differs(got: torch.Tensor) -> float:
        return float((got - want).abs().max())

    name = f"whole step over {keys} keys"
    out = [{"part": f"{name}: StaticCache", "rows": rows, "ms": timed(lambda: forward(model))}]
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    # the model's SDPA (torch's CPU flash kernel), then the matrix products inductor fuses
    for label, attention in (("SDPA", nullcontext()), ("eager attention", eager_attention(model))):
        with attention:
            timing, got = compiled_timing(model, forward, dynamic=False)
        part = f"{name}: StaticCache, {label}, compiled"
        out.append({"part": part, "rows": rows, **timing, "logits_diff": differs(got)})
    if rows == 1:
        row, logits = compiled_row(model, runner.slots, token, keys)
        out.append({"part": f"{name}: {ROW}", **row, "logits_diff": differs(logits)})
    ours.append(timed(engine))  # before and after the others: the machine's drift, halved
    engine_row = {"part": f"{name}: the engine's", "rows": rows, "ms": sum(ours) / 2}
    engine_row |= {"ms_before_after": ours, "logits_diff": differs(engine())}
    return [engine_row, *out]


ROW = "the engine's row, eager attention, compiled"


def compiled_row(
    model: Any, slots: Any, token: torch.Tensor, keys: int
) -> tuple[dict[str, Any], torch.Tensor]:
    """The engine's own row 0 compiled, as the engine could: transformers' forward over a
    ``StaticCache`` whose layers view row 0 of the slot cache's buffers (``slots``), their
    capacity marked dynamic (one compile for any capacity), the row's length given by a
    4D mask; eager attention, frozen weights. The engine does not compile yet."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=1)
    layers: list[Any] = list(cache.layers)  # static layers (no sliding ones: see the caller)
    for layer, slot in zip(layers, slots.slot_layers):
        buffers = slot.buffers
        layer.lazy_initialization(buffers[0][:1, :, :1], buffers[1][:1, :, :1])
        layer.keys, layer.values = buffers[0][:1], buffers[1][:1]  # views: writes land there
        torch._dynamo.mark_dynamic(layer.keys, 2)
        torch._dynamo.mark_dynamic(layer.values, 2)
    mask = torch.zeros(1, 1, 1, slots.capacity, dtype=model.dtype)
    mask[..., keys + 1 :] = torch.finfo(model.dtype).min
    torch._dynamo.mark_dynamic(mask, 3)
    forward = static_step(cache, keys, {"input_ids": token, "attention_mask": mask})
    with eager_attention(model):
        timing, got = compiled_timing(model, forward, dynamic=None)
    return {"rows": 1, **timing}, got


def static_step(
    cache: Any, keys: int, inputs: dict[str, Any]
) -> Callable[[Callable[..., Any]], torch.Tensor]:
    """A forward through ``fn`` (the model or its compiled forward) of ``inputs`` over the
    ``StaticCache`` ``cache``, written at position ``keys`` every time (its layers' counts
    set back); the last token's float32 logits."""
    layers: list[Any] = list(cache.layers)
    rows = inputs["input_ids"].shape[0]
    step = inputs | {"cache": cache, "position_ids": torch.full((rows, 1), keys)}

    def forward(fn: Callable[..., Any]) -> torch.Tensor:
        for layer in layers:
            layer.cumulative_length.fill_(keys)
        return fn(**step).logits[:, -1:].float()  # type: ignore[no-any-return]

    return forward


def compiled_timing(
    model: Any, forward: Callable[[Callable[..., Any]], torch.Tensor], dynamic: bool | None
) -> tuple[dict[str, float], torch.Tensor]:
    """``model.forward`` compiled by inductor (frozen weights, C++ wrapper) and run through
    ``forward``: its median ``ms`` and ``compile_s`` (the first call), and the first call's
    logits."""
    import torch._inductor.config as inductor

    compiled = torch.compile(model.forward, dynamic=dynamic)
    start = time.perf_counter()
    with inductor.patch(freezing=True, cpp_wrapper=True):
        got = forward(compiled)
    seconds = time.perf_counter() - start
    return {"ms": timed(functools.partial(forward, compiled)), "compile_s": seconds}, got


def mlp_rows(model: Any, rows: int) -> list[dict[str, Any]]:
    import torch._inductor.config as inductor

    mlps = [layer.mlp for layer in model_support(model).layers]
    hidden = torch.randn(rows, 1, model.config.hidden_size, dtype=model.dtype)
    eager = timed(lambda: [m(hidden) for m in mlps])
    inductor.freezing = True
    torch._dynamo.config.cache_size_limit = max(64, len(mlps) + 8)
    torch._dynamo.config.recompile_limit = max(64, len(mlps) + 8)
    start = time.perf_counter()
    compiled = [torch.compile(m) for m in mlps]
    for m in compiled:
        m(hidden)
    seconds = time.perf_counter() - start
    fast = timed(lambda: [m(hidden) for m in compiled])
    return [
        {"part": f"MLPs, {len(mlps)} layers, eager", "rows": rows, "ms": eager},
        {
            "part": f"MLPs, {len(mlps)} layers, torch.compile (freezing)",
            "rows": rows,
            "ms": fast,
            "compile_s": seconds,
        },
    ]


def linear_rows(model: Any, rows: int) -> list[dict[str, Any]]:
    """The decoder layers' linear layers and the lm_head, through ``F.linear``, on weights
    reordered for oneDNN as ``PackedHead`` does (the engine packs only the head: each layer
    weight is read once per step from memory), and as ``W @ x.T`` (``core/model/linears.py``:
    the engine's decoder layers over 2-32 rows, where measured faster)."""
    from kvboost_rag.core.model.linears import transposed
    from kvboost_rag.core.model.packed import pack, packed_linear, supported

    if not supported(model):
        return []
    # plain linears and the engine's EngineLinear (a subclass) alike
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings()
    layers = [m for m in linears if m is not head]
    out = []
    for name, group in ((f"linear layers, {len(layers)} of them", layers), ("lm_head", [head])):
        inputs = [torch.randn(rows, 1, m.in_features, dtype=model.dtype) for m in group]
        packed = [pack(m.weight) for m in group]
        calls = list(zip(group, inputs, packed))
        eager, fast, flipped = (
            timed(functools.partial(_run_linears, calls, way))
            for way in ("F.linear", "packed", "transposed")
        )
        first, bias = group[0], group[0].bias
        want = F.linear(inputs[0], first.weight, bias)
        diff = float((packed_linear(inputs[0], packed[0], bias) - want).abs().max())
        flipped_diff = float((transposed(inputs[0], first.weight, bias) - want).abs().max())
        out += [
            {"part": f"{name}: F.linear", "rows": rows, "ms": eager},
            {"part": f"{name}: packed for oneDNN", "rows": rows, "ms": fast, "linear_diff": diff},
            {"part": f"{name}: W @ x.T", "rows": rows, "ms": flipped, "linear_diff": flipped_diff},
        ]
    return out


def _run_linears(calls: list[tuple[Any, torch.Tensor, torch.Tensor]], way: str) -> None:
    from kvboost_rag.core.model.linears import transposed
    from kvboost_rag.core.model.packed import packed_linear

    for module, x, packed in calls:
        if way == "packed":
            packed_linear(x, packed, module.bias)
        elif way == "transposed":
            transposed(x, module.weight, module.bias)
        else:
            F.linear(x, module.weight, module.bias)


def attention_rows(model: Any, rows: int, keys: int) -> list[dict[str, Any]]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    support = model_support(model)
    modules = support.attention
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    query = torch.randn(rows, heads, 1, dim, dtype=model.dtype)
    key, value = (torch.randn(rows, kv_heads, keys, dim, dtype=model.dtype) for _ in range(2))
    mask = torch.ones(rows, 1, 1, keys, dtype=torch.bool) if rows > 1 else None
    scale = dim**-0.5
    sdpa = timed(
        lambda: [sdpa_attention_forward(m, query, key, value, mask, scaling=scale) for m in modules]
    )
    ours = timed(lambda: [few_query_attention(m, query, key, value, mask, scale) for m in modules])
    want = sdpa_attention_forward(modules[0], query, key, value, mask, scaling=scale)[0]
    got = few_query_attention(modules[0], query, key, value, mask, scale)
    diff = float((want.float() - got.float()).abs().max())
    name = f"attention, {len(modules)} layers, 1 query over {keys} keys"
    return [
        {"part": f"{name}: SDPA (CPU flash)", "rows": rows, "ms": sdpa},
        {"part": f"{name}: few_query_attention", "rows": rows, "ms": ours, "max_diff": diff},
    ]


def table(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"{report['model']} {m['dtype']} on {m['cpu']} ({m['threads']} threads), "
        f"torch {m['torch']}",
        f"command: {report['command']}",
        f"{'part':<72}{'rows':>5}{'ms':>9}  note",
    ]
    for row in report["rows"]:
        note = ""
        if "compile_s" in row:
            note = f"compiled in {row['compile_s']:.0f} s"
        if "max_diff" in row:
            note = f"max |diff| from SDPA {row['max_diff']:.1e}"
        if "linear_diff" in row:
            note = f"max |diff| from F.linear {row['linear_diff']:.1e}"
        if "logits_diff" in row:
            note += "; " if note else ""
            note += f"logits' max |diff| from StaticCache's {row['logits_diff']:.1e}"
        lines.append(f"{row['part']:<72}{row['rows']:>5}{row['ms']:>9.2f}  {note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import sys

    parser = ArgumentParser(prog="python -m benchmarks.decode.step", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", type=dtype_name, default=None)
    parser.add_argument("--keys", type=positive, default=900)
    parser.add_argument("--rows", type=positive_list, default=[1, 8])
    parser.add_argument(
        "--parts",
        type=one_of(*PARTS),
        default=list(PARTS),
        help="comma-separated parts to time (default: all)",
    )
    parser.add_argument("--out", type=Path, default=Path("docs/bench"))
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    # float weights: the study times the ways a dense product can run (a GGUF's blocks,
    # the default on an AVX512-VNNI CPU, have one kernel: tests/model/test_blocks.py)
    base = KVBoost.from_pretrained(args.model, dtype=args.dtype, weights="dense")
    rows: list[dict[str, Any]] = []
    parts: dict[str, Callable[[Any, int], list[dict[str, Any]]]] = {
        "whole": functools.partial(whole_step_rows, keys=args.keys),
        "attention": functools.partial(attention_rows, keys=args.keys),
        "linears": linear_rows,
        "mlps": mlp_rows,
    }
    with torch.inference_mode():
        for part in PARTS:
            if part in args.parts:
                for count in args.rows:
                    rows += parts[part](base.model, count)
    command = sys.argv[1:] if argv is None else list(argv)
    report = {
        "command": "python -m benchmarks.decode.step " + " ".join(command),
        "model": args.model,
        "machine": machine(base),
        "rows": rows,
    }
    text = table(report)
    print(text)
    write_report(args.out, f"step-{report['machine']['dtype']}.json", report)
    (args.out / f"step-{report['machine']['dtype']}.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
