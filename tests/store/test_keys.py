import subprocess
import sys

from kvboost_rag.core.store.keys import digest, prefix_block_keys

ROOT = digest(b"root")


def test_only_full_blocks_get_keys() -> None:
    assert len(prefix_block_keys(ROOT, list(range(23)), 8)) == 2
    assert len(prefix_block_keys(ROOT, list(range(24)), 8)) == 3
    assert prefix_block_keys(ROOT, list(range(7)), 8) == []


def test_keys_chain_over_the_whole_prefix() -> None:
    a = prefix_block_keys(ROOT, [1] * 8 + [2] * 8, 8)
    b = prefix_block_keys(ROOT, [3] * 8 + [2] * 8, 8)
    assert a[1] != b[1]  # same block tokens, different parent
    assert prefix_block_keys(ROOT, [1] * 8 + [2] * 8 + [5] * 3, 8) == a


def test_root_separates_namespaces() -> None:
    tokens = list(range(16))
    assert prefix_block_keys(ROOT, tokens, 8) != prefix_block_keys(digest(b"other"), tokens, 8)


def test_part_boundaries_cannot_be_forged() -> None:
    assert digest(b"ab", b"c") != digest(b"a", b"bc")


def test_keys_are_stable_across_processes() -> None:
    code = (
        "from kvboost_rag.core.store.keys import digest, prefix_block_keys;"
        "print(prefix_block_keys(digest(b'root'), list(range(32)), 8)[-1].hex())"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == prefix_block_keys(ROOT, list(range(32)), 8)[-1].hex()
