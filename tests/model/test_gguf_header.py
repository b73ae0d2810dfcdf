"""A GGUF's header read without its values (``model/gguf_header.py``): the same
architecture, formats, shapes and offsets as gguf-py's ``GGUFReader`` on a file written by
gguf-py's writer and on every embedded model's file, and a clear error for a file that is
not one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter

from kvboost_rag.core.model.embedded import EMBEDDED_MODELS, embedded_available, gguf_path
from kvboost_rag.core.model.gguf import FORMATS_FILE, source_formats
from kvboost_rag.core.model.gguf_header import formats, read_header
from kvboost_rag.core.model.loading import default_cache_root


def assert_reads_as_gguf_py(file: Path) -> None:
    header = read_header(file)
    reader = GGUFReader(file)
    assert header.architecture == str(reader.fields["general.architecture"].contents())
    assert list(header.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        ours = header.tensors[t.name]
        theirs = (t.tensor_type.name, tuple(t.data.shape), str(t.data.dtype), t.data_offset)
        assert (ours.kind, ours.shape, ours.dtype, ours.offset) == theirs, t.name
        assert np.array_equal(np.memmap(file, ours.dtype, "r", ours.offset, ours.shape), t.data)


def written(path: Path, alignment: int | None = None) -> Path:
    """A GGUF with every kind of metadata value the header skips (a vocabulary's strings,
    nested and numeric arrays, scalars) and float and block tensors."""
    writer = GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_block_count(2)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}é" for i in range(300)])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_bool("flag", True)
    writer.add_float64("pi", 3.14159)
    rng = np.random.default_rng(0)
    writer.add_tensor("norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.add_tensor("half.weight", rng.standard_normal((3, 64)).astype(np.float16))
    for kind in ("Q4_K", "Q8_0", "Q4_1"):
        quant = GGMLQuantizationType[kind]
        block, size = GGML_QUANT_SIZES[quant]
        raw = rng.integers(0, 255, (4, 256 // block * size), dtype=np.uint8)
        writer.add_tensor(f"{kind}.weight", raw, raw_dtype=quant)  # 4 rows of 256
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_a_written_file_reads_as_gguf_py_reads_it(tmp_path: Path, alignment: int | None) -> None:
    file = written(tmp_path / "tiny.gguf", alignment)
    assert_reads_as_gguf_py(file)
    counts = formats(read_header(file).tensors)
    assert counts == {"F32": 64, "F16": 192, "Q4_K": 1024, "Q8_0": 1024, "Q4_1": 1024}


@pytest.mark.embedded
@pytest.mark.parametrize("alias", sorted(EMBEDDED_MODELS))
def test_every_embedded_file_reads_as_gguf_py_reads_it(alias: str) -> None:
    if not embedded_available(alias):
        pytest.skip(f"{alias}: {EMBEDDED_MODELS[alias].install}")
    assert_reads_as_gguf_py(gguf_path(alias, default_cache_root()))


def test_a_file_that_is_not_a_gguf_or_ends_early_is_refused(tmp_path: Path) -> None:
    notes = tmp_path / "notes.gguf"
    notes.write_bytes(b"not a model, just some text")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_header(notes)
    whole = written(tmp_path / "tiny.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:200])  # inside the vocabulary
    with pytest.raises(ValueError, match="the GGUF header ends early"):
        read_header(cut)
    newer = tmp_path / "v9.gguf"
    newer.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + whole[8:])
    with pytest.raises(ValueError, match="GGUF version 9 is not read here"):
        read_header(newer)


def test_a_folder_converted_before_the_record_reads_the_file_once(tmp_path: Path) -> None:
    file = written(tmp_path / "tiny.gguf")
    folder = tmp_path / "converted"
    folder.mkdir()
    reads: list[Path] = []

    def source() -> Path:
        reads.append(file)
        return file

    want = formats(read_header(file).tensors)
    assert source_formats(folder, source) == want
    assert json.loads((folder / FORMATS_FILE).read_text()) == {"formats": want}
    assert source_formats(folder, source) == want and len(reads) == 1  # then the record
    unwritable = tmp_path / "gone"  # (as root, no mode makes a folder unwritable)
    assert source_formats(unwritable, source) == want and not unwritable.exists()
