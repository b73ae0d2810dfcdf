"""Ctrl-C during ``kvboost-rag warm DIR`` (issue 48 row 5): it exited about 10 s later
with a ``KeyboardInterrupt`` traceback from ``threading.wait`` and kept writing after the
signal (8 files on disk became 32). Now: a prompt stop, one line on stderr, exit status
130, nothing written after the signal; a rerun resumes from what was stored."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

NOTE = "Note {i}: the depot in sector {i} holds {n} crates of tin, counted on a Tuesday. "


def notes(folder: Path, count: int) -> Path:
    folder.mkdir()
    for i in range(count):
        (folder / f"{i:04d}.txt").write_text(NOTE.format(i=i, n=i * 7 + 3) * 2)
    return folder


def stored(cache: Path) -> set[Path]:
    return set(cache.rglob("*.safetensors"))


def warm(folder: Path, cache: Path, model: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "kvboost_rag.cli", "warm", str(folder)]
    command += ["--cache-dir", str(cache), "--model", model, "--dtype", "float32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True
    )


def test_sigint_during_warm_stops_at_once_with_one_line_and_status_130(
    tmp_path: Path, tiny_model_dir: str
) -> None:
    folder, cache = notes(tmp_path / "notes", 3000), tmp_path / "cache"
    process = warm(folder, cache, tiny_model_dir)
    deadline = time.monotonic() + 120
    while len(stored(cache)) < 8:  # well into the warm: passages are on disk
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the warm wrote nothing in 2 minutes"
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    sent, before = time.monotonic(), stored(cache)
    out, err = process.communicate(timeout=60)
    took = time.monotonic() - sent
    assert process.returncode == 130, (process.returncode, err[-3000:])
    assert took < 3.0, f"stopped {took:.1f} s after the signal"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    said = [line for line in lines if "encoding:" not in line]  # not tqdm's progress bar
    assert said == ["kvboost-rag warm: interrupted: what was stored is kept (rerun to resume)"]
    # At most the one write under way at the signal ends after it; no batch starts.
    assert len(stored(cache) - before) <= 1, len(stored(cache) - before)
    assert len(stored(cache)) < 3000 and "warmed" not in out
