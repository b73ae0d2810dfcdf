"""cache_secret: entries are signed, and a planted entry (valid checksum, no or a wrong
signature) is rejected with the secret set and accepted without it, as documented."""

from pathlib import Path

import pytest
import torch
from conftest import found, make_model, make_tokenizer
from warm_worker import corpus

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.store import codec
from kvboost_rag.core.store.keys import digest

KEY = digest(b"k")
TOKENS = tuple(range(6))
SECRET = b"correct horse battery staple"


def kv(fill: float = 1.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((1, 2, 6, 4), fill), torch.full((1, 2, 6, 4), fill)) for _ in range(2)]


def planted(signed_with: bytes | None) -> tuple[dict, dict]:
    """An attacker's entry: steering KV, a valid checksum, signed with their own secret."""
    return codec.encode(KEY, "fp", TOKENS, kv(9.0), "none", True, signed_with)


@pytest.mark.parametrize("attacker", [None, b"a guessed secret"])
def test_planted_entries_are_rejected_with_the_secret_and_accepted_without(attacker) -> None:
    tensors, meta = planted(attacker)
    with pytest.raises(ValueError, match="unsigned|signature does not match"):
        codec.decode(tensors, meta, KEY, "fp", SECRET)
    assert codec.decode(tensors, meta, KEY, "fp").kv[0][0][0, 0, 0, 0] == 9.0  # no secret


def test_signed_entries_roundtrip_and_any_edit_breaks_the_signature() -> None:
    blob = codec.to_bytes(KEY, "fp", TOKENS, kv(), "int8", True, SECRET)
    assert codec.from_bytes(blob, KEY, "fp", SECRET).tokens == TOKENS
    tensors, meta = codec.encode(KEY, "fp", TOKENS, kv(), "none", True, SECRET)
    tensors["k0"] = tensors["k0"] * 2  # edited KV with its checksum redone
    meta["checksum"] = codec.checksum(tensors)
    with pytest.raises(ValueError, match="signature does not match"):
        codec.decode(tensors, meta, KEY, "fp", SECRET)
    tensors, meta = codec.encode(KEY, "fp", TOKENS, kv(), "none", True, SECRET)
    meta["approximate"] = "0"  # a signed field changed
    with pytest.raises(ValueError, match="signature does not match"):
        codec.decode(tensors, meta, KEY, "fp", SECRET)


def engine(cache_dir: Path, secret: str | None, **config) -> KVBoost:
    config = KVBoostConfig(cache_dir=cache_dir, cache_secret=secret, **config)
    return KVBoost(make_model("llama"), make_tokenizer(), config)


def test_a_planted_disk_file_is_removed_with_the_secret(tmp_path: Path) -> None:
    docs = corpus(3)
    engine(tmp_path, "s3cret").warm_passages(docs)  # signed files
    attacker = engine(tmp_path / "elsewhere", None)  # no secret: unsigned, valid checksums
    attacker.warm_passages(docs)
    for theirs in (tmp_path / "elsewhere").rglob("*.safetensors"):
        mine = tmp_path / theirs.relative_to(tmp_path / "elsewhere")
        mine.write_bytes(theirs.read_bytes())  # planted over the signed files
    reader = engine(tmp_path, "s3cret")
    with pytest.warns(UserWarning, match="unsigned entry"):
        result = reader.generate("Which code?", passages=docs, max_new_tokens=1)
    assert result.passages_missed == 3 and reader.stats().disk.corrupt == 3  # type: ignore[union-attr]
    trusting = engine(tmp_path / "elsewhere", None)  # without a secret they are served
    assert found(trusting.generate("Which code?", passages=docs, max_new_tokens=1)) == 3


def test_the_secret_comes_from_the_environment_and_never_shows(monkeypatch) -> None:
    monkeypatch.setenv("KVBOOST_CACHE_SECRET", "from-env")
    assert KVBoostConfig().secret() == b"from-env"
    assert KVBoostConfig(cache_secret="given").secret() == b"given"
    assert "given" not in repr(KVBoostConfig(cache_secret="given"))
    monkeypatch.delenv("KVBOOST_CACHE_SECRET")
    assert KVBoostConfig().secret() is None


def test_a_planted_redis_value_is_deleted_with_the_secret(redis_server) -> None:
    docs = corpus(3)
    url = redis_server.url
    writer = KVBoost(make_model("llama"), make_tokenizer(), KVBoostConfig(remote_url=url))
    writer.warm_passages(docs)  # unsigned values, as an attacker with server access writes
    config = KVBoostConfig(remote_url=url, cache_secret="s3cret")
    reader = KVBoost(make_model("llama"), make_tokenizer(), config)
    with pytest.warns(UserWarning, match="unsigned entry"):
        result = reader.generate("Which code?", passages=docs, max_new_tokens=1)
    assert result.passages_missed == 3 and reader.stats().remote.corrupt == 3  # type: ignore[union-attr]
