"""Cache keys: pure functions of their inputs, stable across processes and machines.

A prefix block's key chains its parent's key, so equal keys mean equal token streams from
position 0 (vLLM-style block hashing). Python's built-in ``hash`` is never used: it differs
between processes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

KEY_BYTES = 16


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Canonical byte form of token ids (little-endian int32)."""
    return np.asarray(tokens, dtype="<i4").tobytes()


def digest(*parts: bytes) -> bytes:
    """blake2b over length-prefixed parts, so part boundaries cannot be forged."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def prefix_block_keys(root: bytes, tokens: Sequence[int], block_tokens: int) -> list[bytes]:
    """Chained keys of every *full* block of ``tokens``.

    ``root`` folds in everything that changes the KV besides the tokens (model fingerprint,
    cache kind), so caches of different models never share a key.
    """
    keys: list[bytes] = []
    parent = root
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        parent = digest(b"prefix", parent, token_bytes(tokens[start : start + block_tokens]))
        keys.append(parent)
    return keys
