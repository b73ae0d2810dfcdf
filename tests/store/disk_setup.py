"""What the disk-tier fault tests share: an engine over a cache folder of the tiny Llama, and
a folder warmed by one."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import make_model, make_tokenizer
from fault_worker import answers, config

from kvboost_rag import KVBoost
from kvboost_rag.core.store.disk import DiskStore


def engine(
    cache_dir: Path, model: torch.nn.Module | None = None, tokenizer=None, **settings
) -> KVBoost:
    model, tokenizer = model or make_model("llama"), tokenizer or make_tokenizer()
    return KVBoost(model, tokenizer, config(cache_dir, **settings))


def files(root: Path, pattern: str = "*.safetensors") -> list[Path]:
    return sorted(root.rglob(pattern))


def assert_all_valid(root: Path) -> int:
    """Every entry file in ``root`` decodes as its own key's; returns how many there are."""
    found = files(root)
    for path in found:
        store = DiskStore(root, bytes.fromhex(path.parent.parent.name), 10**12)
        assert store.get(bytes.fromhex(path.stem), None) is not None, f"{path} is not valid"
    return len(found)


def warmed(root: Path, model: torch.nn.Module | None = None, tokenizer=None) -> Path:
    """``root`` holding the prefix blocks of PROMPTS (spilled from a small memory)."""
    served = engine(root, model, tokenizer)
    answers(served)
    served.flush()
    assert files(root)
    return root
