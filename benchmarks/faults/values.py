"""Faults in the values rather than the server: damaged values (bytes cut or flipped,
another model's or another key's value, a header field changed) and two processes
writing the same corpus at once. Each is checked by decoding every value the way a
reader does (``codec.from_bytes(data, key, fingerprint)``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict

import torch

from benchmarks.faults.lab import MODEL, Lab, engine_config, make_pool
from benchmarks.faults.watch import Watch
from kvboost_rag import KVBoost, warm_corpus
from kvboost_rag.core.store import codec
from kvboost_rag.core.store.remote import import_redis

WRITERS = 2
READY = "faults:ready"  # the writers' start line (outside the engine's namespace)
Damage = Callable[[bytes, bytes], bytes]  # (name, clean value) -> damaged value


def damaged(lab: Lab, watch: Watch) -> None:
    """Values of passages the first prompts use are replaced: truncated, one bit flipped
    in the tensors or in the header's checksum, another model's value, another key's."""
    names = _names(lab)[:5]
    spare = next(name for name in lab.golden if name not in names)  # not read as itself
    kinds: dict[str, Damage] = {
        "truncated": lambda name, value: value[: len(value) // 2],
        "bit in tensors": lambda name, value: _flip(value, len(value) // 2),
        "bit in checksum": lambda name, value: _flip(value, _field(value, b"checksum")),
        "other model": lambda name, value: _foreign(lab, name, value),
        "other key": lambda name, value: lab.golden[spare],
    }
    _serve_damaged(lab, watch, dict(zip(kinds, names)), kinds)


def damaged_field(lab: Lab, watch: Watch) -> None:
    """One bit of the header's "layers" field flipped ("30" -> "20"), in the first passage
    of prompt 0 and in a later passage of another prompt: the checksum covers the tensors,
    not this field, so only checking it against them keeps such a value from being read
    as 20 layers (before that check: an AssertionError, or silently wrong KV)."""
    names, firsts = _names(lab), {lab.passage_name(q.passages[0]) for q in lab.queries}
    q0 = {lab.passage_name(t) for t in lab.queries[0].passages}
    later = next((n for n in names if n not in firsts and n not in q0), names[-1])
    flip: Damage = lambda name, value: _flip(value, _field(value, b"layers"))  # noqa: E731
    victims = {"layers of a first passage": names[0], "layers of a later passage": later}
    _serve_damaged(lab, watch, victims, dict.fromkeys(victims, flip))


def two_writers(lab: Lab, watch: Watch) -> None:
    """Two processes warm the same corpus into one server at the same time."""
    server = watch.server(lab)
    cmd = [sys.executable, "-m", "benchmarks.faults", "--writer", server.url]
    cmd += ["--passages", str(len(lab.texts)), "--threads", str(torch.get_num_threads())]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    procs = [subprocess.Popen(cmd, **pipes) for _ in range(WRITERS)]  # type: ignore[call-overload]
    for i, proc in enumerate(procs):
        out, err = proc.communicate()
        if proc.returncode:
            watch.raised.append(f"writer {i}: exit {proc.returncode}: {err.strip()[-300:]}")
            continue
        stats = json.loads(out.strip().splitlines()[-1])
        warned = err.count("kvboost-rag:")
        watch.note(
            f"writer {i}: {stats['writes']} writes, {stats['skipped']} skipped, "
            f"{stats['errors']} errors, {warned} warnings"
        )
    watch.note(lab.check_values(server))
    watch.serve(lab, watch.engine(lab, server.url), range(len(lab.queries)))


def write_corpus(url: str, count: int) -> None:
    """A writer process of ``two_writers``: load, wait for the other, warm, print stats."""
    engine = KVBoost.from_pretrained(MODEL, dtype="float32", config=engine_config(url))
    texts = [p.text for p in make_pool(engine.tokenizer, count)]
    client = import_redis().Redis.from_url(url)
    client.incr(READY)
    deadline = time.monotonic() + 120
    while int(client.get(READY) or 0) < WRITERS and time.monotonic() < deadline:
        time.sleep(0.01)
    warm_corpus(engine, texts, progress=False)
    remote = engine.stats().remote
    assert remote is not None, "the engine was configured with a remote_url"
    print(json.dumps(asdict(remote)))


def _serve_damaged(
    lab: Lab, watch: Watch, victims: dict[str, bytes], kinds: dict[str, Damage]
) -> None:
    """Seed a server, damage ``victims`` (kind -> name), serve every prompt, then check
    whether each damaged key holds a valid value again (dropped and rewritten)."""
    server = watch.server(lab)
    lab.seed(server)
    client = server.client()
    for kind, name in victims.items():
        client.set(name, kinds[kind](name, lab.golden[name]))
    engine = watch.engine(lab, server.url)
    watch.serve(lab, engine, range(len(lab.queries)))
    engine.flush()
    valid = sum(_decodes(lab, name, client.get(name)) for name in victims.values())
    used = "; ".join(f"{kind}: {_uses(lab, name)}" for kind, name in victims.items())
    watch.note(f"damaged {len(victims)} values, used by prompt#passage {used}")
    watch.note(f"{valid}/{len(victims)} of them hold a valid value after the requests")


def _uses(lab: Lab, name: bytes) -> str:
    """Where prompts use the passage stored under ``name``: "0#1 2#3" (prompt#position)."""
    return " ".join(
        f"{i}#{pos + 1}"
        for i, q in enumerate(lab.queries)
        for pos, text in enumerate(q.passages)
        if lab.passage_name(text) == name
    )


def _names(lab: Lab) -> list[bytes]:
    """Redis names of the passages, in the order the prompts first use them."""
    names = [lab.passage_name(t) for q in lab.queries for t in q.passages]
    return list(dict.fromkeys(names))


def _field(value: bytes, name: bytes) -> int:
    """Where the header's metadata ``name`` value starts."""
    return value.index(b'"' + name + b'":"') + len(name) + 4


def _flip(value: bytes, at: int) -> bytes:
    return value[:at] + bytes([value[at] ^ 0x01]) + value[at + 1 :]


def _foreign(lab: Lab, name: bytes, value: bytes) -> bytes:
    """The same entry as another model (another fingerprint) would have written it."""
    key = _key(name)
    entry = codec.from_bytes(value, key, lab.fingerprint)
    return codec.to_bytes(key, "0" * 32, entry.tokens, entry.kv, "none", entry.approximate)


def _decodes(lab: Lab, name: bytes, value: bytes | None) -> bool:
    try:
        entry = codec.from_bytes(value or b"", _key(name), lab.fingerprint)
    except ValueError:
        return False
    return len(entry.kv) == lab.base.model.config.num_hidden_layers


def _key(name: bytes) -> bytes:
    return bytes.fromhex(name.decode().split(":")[2])
