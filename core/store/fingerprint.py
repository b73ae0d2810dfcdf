"""Model fingerprint: identifies everything about a model that changes its KV.

Folded into every cache key so that a cache made by another model, dtype, tokenizer or
rope configuration is never used.
"""

from __future__ import annotations

import json

import torch

from kvboost_rag.core.store.keys import digest

# Elements sampled from each parameter: enough to tell checkpoints apart (fine-tunes
# change every tensor) without hashing hundreds of MB at start-up.
_SAMPLES_PER_TENSOR = 512


def model_fingerprint(model: torch.nn.Module, tokenizer: object) -> bytes:
    """A 16-byte digest of config, dtype, weights (sampled) and tokenizer."""
    config = model.config.to_dict()  # type: ignore[union-attr,operator]
    for volatile in ("_name_or_path", "transformers_version", "_commit_hash"):
        config.pop(volatile, None)
    parts = [
        type(model).__name__.encode(),
        json.dumps(config, sort_keys=True, default=str).encode(),
        _weights_sample(model),
        _tokenizer_digest(tokenizer),
    ]
    return digest(*parts)


def _weights_sample(model: torch.nn.Module) -> bytes:
    parts = []
    with torch.no_grad():
        for name, param in model.state_dict().items():
            flat = param.detach().reshape(-1)
            step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
            sample = flat[::step][:_SAMPLES_PER_TENSOR].to("cpu", torch.float32)
            header = f"{name}:{tuple(param.shape)}:{param.dtype}".encode()
            parts.append(digest(header, sample.numpy().tobytes()))
    return digest(*parts)


def _tokenizer_digest(tokenizer: object) -> bytes:
    vocab = sorted(tokenizer.get_vocab().items())  # type: ignore[attr-defined]
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    return digest(
        json.dumps(vocab).encode(),
        json.dumps(special).encode(),
    )
