"""Stored KV entries: the bytes the disk and shared tiers hold, and the optional codec.

An entry is a safetensors blob (tensors and a JSON header, never pickle): ``tokens``
(int32), per layer ``k{i}`` / ``v{i}`` and, under a codec, their scales ``ks{i}`` / ``vs{i}``.
The header's metadata repeats the model fingerprint and the key, names the codec and the
model's dtype, and carries an xxh3 checksum over every tensor: a foreign, damaged or
truncated entry fails ``decode`` with ``ValueError`` and is never served.

Codecs (``CODECS``): "none" stores the KV as computed; "int8" and "fp8"
(``torch.float8_e4m3fn``) store one byte per element with symmetric absmax scales, keys
scaled per channel over the entry's tokens and values per token (KIVI: key outliers sit in
fixed channels, value outliers in tokens). Scales are float16 (1.6 % of a bf16 passage's
bytes). Only approximate KV (passages, sessions) is ever coded: exact prefix blocks are
stored as computed, so "exact" fidelity stays bit-faithful from every tier.

A checksum catches damage, not malice. With a secret (``cache_secret``) every entry also
carries an HMAC-SHA256 over its metadata and every tensor's name, dtype, shape and bytes;
an unsigned or wrongly signed entry then fails ``decode`` like a damaged one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math

import torch
import xxhash
from safetensors.torch import save

from kvboost_rag.core.choices import KV_CODECS
from kvboost_rag.core.model.kv import LayerKV, kv_nbytes
from kvboost_rag.core.store.memory import Entry

FORMAT = "kvboost-kv-2"  # files without a "codec" field (0.1) read as codec "none"
CODECS: tuple[str, ...] = KV_CODECS
_QUANT = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.bfloat16, torch.float16)}
# The safetensors names of the dtypes entries hold (token ids, KV, codes, scales).
_FILE_DTYPES = {
    "I32": torch.int32,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn,
}
_TINY_SCALE = torch.finfo(torch.float16).tiny  # scales are stored as float16
_SIGNED = ("format", "fingerprint", "key", "layers", "codec", "dtype", "approximate")


def encode(
    key: bytes,
    fingerprint: str,
    tokens: tuple[int, ...],
    kv: LayerKV,
    codec: str,
    approximate: bool,
    secret: bytes | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of an entry. ``codec`` applies only when ``approximate``."""
    codec = codec if approximate else "none"
    tensors = {"tokens": torch.tensor(tokens, dtype=torch.int32)}
    for i, (k, v) in enumerate(kv):
        k, v = k.detach().cpu(), v.detach().cpu()
        if codec == "none":
            tensors[f"k{i}"], tensors[f"v{i}"] = k.contiguous(), v.contiguous()
        else:
            tensors[f"k{i}"], tensors[f"ks{i}"] = _quantize(k, -2, codec)  # per channel
            tensors[f"v{i}"], tensors[f"vs{i}"] = _quantize(v, -1, codec)  # per token
    meta = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "key": key.hex(),
        "layers": str(len(kv)),
        "codec": codec,
        "dtype": str(kv[0][0].dtype).removeprefix("torch.") if kv else "float32",
        "approximate": "1" if approximate else "0",
        "checksum": checksum(tensors),
    }
    if secret:
        meta["signature"] = signature(secret, tensors, meta)
    return tensors, meta


def to_bytes(
    key: bytes,
    fingerprint: str,
    tokens: tuple[int, ...],
    kv: LayerKV,
    codec: str,
    approximate: bool,
    secret: bytes | None = None,
) -> bytes:
    tensors, meta = encode(key, fingerprint, tokens, kv, codec, approximate, secret)
    return save(tensors, metadata=meta)


def decode(
    tensors: dict[str, torch.Tensor],
    meta: dict[str, str],
    key: bytes,
    fingerprint: str,
    secret: bytes | None = None,
) -> Entry:
    """The entry, decoded to the model's dtype; ``ValueError`` when it is foreign or damaged,
    or (with a ``secret``) unsigned or wrongly signed."""
    try:
        ok = (
            meta.get("format") == FORMAT
            and meta.get("fingerprint") == fingerprint
            and meta.get("key") == key.hex()
            and meta.get("checksum") == checksum(tensors)
        )
        if not ok:
            raise ValueError("checksum, key or model fingerprint does not match")
        if secret:
            check_signature(secret, tensors, meta)
        codec = meta.get("codec", "none")
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}")
        dtype = _DTYPES[meta.get("dtype", "")] if codec != "none" else None
        tokens = tuple(tensors["tokens"].tolist())
        _check_layout(tensors, meta, codec, len(tokens))
        kv = [_layer(tensors, i, dtype) for i in range(int(meta["layers"]))]
    except KeyError as error:
        raise ValueError(f"missing field {error}") from error
    except RuntimeError as error:  # tensors that do not fit together (another layout)
        raise ValueError(f"inconsistent tensors: {error}") from error
    return Entry(tokens, kv, kv_nbytes(kv), meta.get("approximate") == "1")


def from_bytes(data: bytes, key: bytes, fingerprint: str, secret: bytes | None = None) -> Entry:
    """Parse and check an entry held as bytes; ``ValueError`` when it is not a whole,
    valid entry of this key and model (truncated values included)."""
    return from_buffer(bytearray(data), key, fingerprint, secret)


def from_buffer(
    buffer: bytearray, key: bytes, fingerprint: str, secret: bytes | None = None
) -> Entry:
    """``from_bytes`` without a copy: the entry's tensors are views of ``buffer``."""
    tensors, meta = _parse(buffer)
    return decode(tensors, meta, key, fingerprint, secret)


def _parse(buffer: bytearray) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors (views of ``buffer``) and metadata of a safetensors blob. Every size the
    header claims is checked against the buffer before a tensor is made."""
    try:
        size = int.from_bytes(buffer[:8], "little")
        if len(buffer) < 8 or 8 + size > len(buffer):
            raise ValueError(f"a {size}-byte header in a {len(buffer)}-byte value")
        header = json.loads(buffer[8 : 8 + size])
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise ValueError("metadata is not a mapping")
        tensors = {name: _view(buffer, 8 + size, info) for name, info in header.items()}
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as error:
        raise ValueError(f"not a safetensors entry: {error}") from error
    return tensors, meta


def _view(buffer: bytearray, start: int, info: dict) -> torch.Tensor:
    dtype = _FILE_DTYPES[info["dtype"]]
    shape = [int(n) for n in info["shape"]]
    begin, end = (int(n) for n in info["data_offsets"])
    count = math.prod(shape)
    if min(shape, default=0) < 0 or not 0 <= begin <= end == begin + count * dtype.itemsize:
        raise ValueError(f"{info['dtype']}{shape} does not fit bytes {begin}..{end}")
    if start + end > len(buffer):
        raise ValueError(f"bytes {begin}..{end} run past the end of the value")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=start + begin).view(shape)


def signature(secret: bytes, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    """HMAC-SHA256 over the metadata fields that shape the entry and every tensor's name,
    dtype, shape and bytes (length-prefixed, so no field can run into the next)."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for field in _SIGNED:
        _update(mac, field.encode(), meta.get(field, "").encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        _update(mac, name.encode(), str(t.dtype).encode(), repr(tuple(t.shape)).encode())
        _update(mac, memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
    return mac.hexdigest()


def check_signature(secret: bytes, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    found = meta.get("signature")
    if not found:
        raise ValueError("unsigned entry, and a cache_secret is set")
    if not hmac.compare_digest(found, signature(secret, tensors, meta)):
        raise ValueError("signature does not match this cache_secret")


def _update(mac: hmac.HMAC, *parts: bytes | memoryview) -> None:
    for part in parts:
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)


def stored_bytes_per_token(kv: LayerKV, codec: str) -> float:
    """Bytes per token of ``kv`` (one entry) stored under ``codec``, tokens and header
    excluded: what the sizing rule multiplies by corpus tokens."""
    tokens = kv[0][0].shape[-2]
    tensors, _ = encode(b"", "", (0,) * tokens, kv, codec, True)
    del tensors["tokens"]
    return sum(t.numel() * t.element_size() for t in tensors.values()) / max(tokens, 1)


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    # xxh3 hashes the tensors' memory in place at memory speed: a serving process checks
    # every entry it reads, so a slower hash would show up in TTFT.
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    return h.hexdigest()


def _check_layout(
    tensors: dict[str, torch.Tensor], meta: dict[str, str], codec: str, tokens: int
) -> None:
    """The tensors are exactly the entry's layers (the checksum covers tensors, not the
    metadata beside them), each [batch, heads, positions, head_dim] with one length, at
    most the token ids' (a passage's ids include the prefix it was encoded after)."""
    layers = int(meta["layers"])
    names = [f"k{i}" for i in range(layers)] + [f"v{i}" for i in range(layers)]
    scales = [f"{n[0]}s{n[1:]}" for n in names] if codec != "none" else []
    if set(tensors) != {"tokens", *names, *scales}:
        raise ValueError(f"tensors do not match {layers} layers of codec {codec!r}")
    lengths = {tensors[n].shape[-2] if tensors[n].dim() == 4 else -1 for n in names}
    if len(lengths) > 1 or not 0 <= min(lengths, default=0) <= tokens:
        raise ValueError(f"layer tensors of lengths {sorted(lengths)} for {tokens} token ids")


def _quantize(t: torch.Tensor, dim: int, codec: str) -> tuple[torch.Tensor, torch.Tensor]:
    qtype, qmax = _QUANT[codec]
    x = t.float()
    scale = (x.abs().amax(dim, keepdim=True) / qmax).clamp_min(_TINY_SCALE).half()
    q = (x / scale.float()).clamp(-qmax, qmax)
    if qtype == torch.int8:
        # Round half to even by the float32 magic number (exact for |q| < 2**22): measured
        # 0.03 ms per 55k-element tensor where torch.round took 5.4 ms with 2 threads busy.
        q = (q + 12582912.0) - 12582912.0
    return q.to(qtype).contiguous(), scale.contiguous()


def _layer(
    tensors: dict[str, torch.Tensor], i: int, dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = tensors[f"k{i}"], tensors[f"v{i}"]
    if dtype is None:
        return k, v
    return (
        (k.float() * tensors[f"ks{i}"].float()).to(dtype),
        (v.float() * tensors[f"vs{i}"].float()).to(dtype),
    )
