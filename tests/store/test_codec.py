"""Stored KV entries and the int8 / fp8 codec: bounds, checks, exact KV never coded."""

import pytest
import torch

from kvboost_rag.core.store import codec
from kvboost_rag.core.store.keys import digest

KEY = digest(b"k")
TOKENS = tuple(range(40))


def kv(dtype: torch.dtype = torch.bfloat16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    out = []
    for _ in range(3):
        k = torch.randn(1, 2, 40, 16) * torch.linspace(0.1, 20, 16)  # outlier channels
        v = torch.randn(1, 2, 40, 16) * torch.linspace(0.1, 5, 40)[:, None]  # per-token scale
        out.append((k.to(dtype), v.to(dtype)))
    return out


def roundtrip(data, name: str, approximate: bool = True):
    blob = codec.to_bytes(KEY, "fp", TOKENS, data, name, approximate)
    return codec.from_bytes(blob, KEY, "fp"), len(blob)


def test_uncoded_entries_are_bit_exact() -> None:
    data = kv()
    entry, _ = roundtrip(data, "none")
    assert entry.tokens == TOKENS and entry.approximate
    assert all(torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(entry.kv, data))


@pytest.mark.parametrize(("name", "bound"), [("int8", 0.5 / 127), ("fp8", 1 / 16)])
def test_codec_error_is_bounded_by_each_scale(name: str, bound: float) -> None:
    data = kv(torch.float32)
    entry, size = roundtrip(data, name)
    for (k, v), (k2, v2) in zip(data, entry.kv):
        assert k2.dtype == torch.float32  # decoded to the model's dtype
        # keys: per channel, values: per token; error within half a step of that scale
        # (int8) or fp8's relative precision (2^-4 with rounding) of the largest element.
        assert ((k - k2).abs() <= bound * k.abs().amax(-2, keepdim=True) * 1.01 + 1e-6).all()
        assert ((v - v2).abs() <= bound * v.abs().amax(-1, keepdim=True) * 1.01 + 1e-6).all()
    plain = len(codec.to_bytes(KEY, "fp", TOKENS, data, "none", True))
    assert size < 0.35 * plain  # 1 byte per element instead of 4, scales, header


def test_bytes_per_token_of_a_bf16_entry_halve() -> None:
    data = kv()
    plain = codec.stored_bytes_per_token(data, "none")
    assert plain == 3 * 2 * 2 * 16 * 2  # layers x (k, v) x heads x head_dim x bf16
    for name in ("int8", "fp8"):
        coded = codec.stored_bytes_per_token(data, name)
        assert plain / 2 < coded < plain / 2 * 1.1  # scales cost under 10 % here


def test_exact_kv_is_never_coded() -> None:
    data = kv()
    entry, _ = roundtrip(data, "int8", approximate=False)
    assert not entry.approximate
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(entry.kv, data))


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty"])
def test_damaged_values_raise_value_error(damage: str) -> None:
    blob = bytearray(codec.to_bytes(KEY, "fp", TOKENS, kv(), "int8", True))
    if damage == "flip":
        blob[-5] ^= 0xFF
    elif damage == "truncate":
        blob = blob[: len(blob) // 2]
    elif damage == "garbage":
        blob = bytearray(b"\x00" * 8 + b"not json at all")
    else:
        blob = bytearray()
    with pytest.raises(ValueError):
        codec.from_bytes(bytes(blob), KEY, "fp")


def test_foreign_key_or_model_raises() -> None:
    blob = codec.to_bytes(KEY, "fp", TOKENS, kv(), "fp8", True)
    with pytest.raises(ValueError, match="fingerprint"):
        codec.from_bytes(blob, KEY, "another-model")
    with pytest.raises(ValueError, match="fingerprint"):
        codec.from_bytes(blob, digest(b"other"), "fp")


def test_a_checksummed_value_of_another_layout_raises_value_error() -> None:
    tensors, meta = codec.encode(KEY, "fp", TOKENS, kv(), "int8", True)
    tensors["ks0"] = tensors["ks0"][:, :1, :, :1].repeat(1, 1, 1, 3)  # scales do not fit
    meta["checksum"] = codec.checksum(tensors)
    with pytest.raises(ValueError, match="inconsistent"):
        codec.decode(tensors, meta, KEY, "fp")


def test_sizes_in_a_header_are_checked_against_the_value_before_allocating() -> None:
    import json

    huge = json.dumps(
        {"tokens": {"dtype": "I32", "shape": [10**12], "data_offsets": [0, 4 * 10**12]}}
    )
    for blob in (
        (2**62).to_bytes(8, "little") + b"{}",  # a header length past the value
        len(huge).to_bytes(8, "little") + huge.encode(),  # a 4 TB tensor in a tiny value
    ):
        with pytest.raises(ValueError, match="not a safetensors entry"):
            codec.from_bytes(blob, KEY, "fp")


@pytest.mark.parametrize("layers", ["2", "4", "-1", "x"])
def test_a_layers_field_that_does_not_match_the_tensors_raises(layers: str) -> None:
    tensors, meta = codec.encode(KEY, "fp", TOKENS, kv(), "int8", True)
    meta["layers"] = layers  # metadata beside the checksummed tensors
    with pytest.raises(ValueError):
        codec.decode(tensors, meta, KEY, "fp")
