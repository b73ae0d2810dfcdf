"""``POST /v1/kvboost/warm`` and ``kvboost-rag warm --server`` against a real server
process: the WarmResult's counts, idempotence, progress, and prompts that then reuse the
warmed passages."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from cli_run import run
from server_process import ServerProcess

pytestmark = pytest.mark.embedded

KEY = "warm-key-0123"
MODEL = "smollm2-135m-instruct"
SYSTEM = "Answer from the documents."
DOCS = [
    "The Loire is the longest river in France, flowing 1,006 kilometres to the Atlantic.",
    "Mont Blanc, at 4,806 metres, is the highest mountain of the Alps and of France.",
]


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    with ServerProcess(MODEL, "--dtype", "float32", "--api-key", KEY) as process:
        yield process


def post(server: ServerProcess, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}/kvboost/warm", json=body, headers=headers, timeout=120)


def test_warm_counts_and_is_idempotent(server: ServerProcess) -> None:
    first = post(server, {"documents": DOCS, "system": SYSTEM})
    assert first.status_code == 200, first.text
    counts = first.json()
    assert counts["object"] == "kvboost.warm" and counts["documents"] == 2
    assert counts["units"] >= 2 and counts["new"] == counts["units"] and counts["cached"] == 0
    assert counts["tokens"] > 0 and counts["bytes"] > 0 and counts["failed"] == []
    again = post(server, {"documents": DOCS, "system": SYSTEM}).json()
    assert again["new"] == 0 and again["cached"] == counts["units"]


def test_a_long_document_is_split_into_pieces_and_says_so(server: ServerProcess) -> None:
    """server.md said a document too long for the context window is refused; warming
    splits it into pieces of at most max_passage_tokens (512), and the result now says how
    many each document became."""
    long = " ".join(
        f"Sentence {i} tells of river number {i} in a land far away." for i in range(400)
    )
    repeated = "water " * 3000
    counts = post(server, {"documents": [long, repeated, DOCS[0]], "system": SYSTEM}).json()
    assert counts["documents"] == 3, counts
    pieces = counts["pieces"]
    assert len(pieces) == 3 and pieces[0] >= 8 and pieces[1] >= 5 and pieces[2] == 1, pieces
    # the repeated document's pieces are mostly one piece given again: fewer units
    assert counts["units"] < sum(pieces)


# Long enough to be reused: the engine prefills passages of under 64 tokens plainly, and
# counts them unused (``passages_unused``), not hit.
LONG_DOCS = [
    f"{DOCS[0]} It rises in the Massif Central and flows north, then west, through Orleans, "
    "Tours and Nantes; its valley holds hundreds of castles built in the sixteenth century, "
    "and the whole valley between Sully and Chalonnes is a World Heritage Site.",
    f"{DOCS[1]} It stands on the border of France and Italy, above Chamonix and Courmayeur, "
    "and a road tunnel of 11.6 kilometres runs beneath it between the two countries; it "
    "was first climbed in 1786 by Jacques Balmat and Michel Paccard.",
]


def test_a_chat_after_warming_reuses_the_passages(server: ServerProcess) -> None:
    post(server, {"documents": LONG_DOCS, "system": SYSTEM}).raise_for_status()
    client = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    question = "\n\n".join(LONG_DOCS) + "\n\nWhat is the longest river in France?"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    assert reply.usage.prompt_tokens_details.cached_tokens > 0
    assert reply.usage.model_extra["kvboost"]["passages_hit"] >= len(DOCS)
    assert reply.usage.model_extra["kvboost"]["passages_missed"] == 0


def test_streamed_warm_reports_progress_then_the_summary(server: ServerProcess) -> None:
    documents = [f"Document {i}: the number {i} squared is {i * i}." for i in range(5)]
    body = {"documents": documents, "prefix": "Context:\n", "stream": True, "batch_size": 2}
    headers = {"Authorization": f"Bearer {KEY}"}
    url = f"{server.url}/kvboost/warm"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in response.iter_lines() if line]
    progress = [line["encoded"] for line in lines[:-1]]
    assert all(line["object"] == "kvboost.warm.progress" for line in lines[:-1])
    assert len(progress) >= 2 and progress == sorted(progress)
    summary = lines[-1]
    assert summary["object"] == "kvboost.warm" and summary["new"] == summary["units"]
    assert progress[-1] == summary["new"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"documents": []}, "documents"),
        ({"documents": "one string"}, "documents"),
        ({"documents": ["a"], "prefix": "x", "system": "y"}, None),
        ({"documents": ["a"], "batch_size": 0}, "batch_size"),
    ],
)
def test_bad_warms_are_refused_in_openais_shape(server, body, param) -> None:
    response = post(server, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_warm_needs_the_key(server: ServerProcess) -> None:
    assert post(server, {"documents": DOCS}, key=None).status_code == 401


def test_the_cli_warms_a_folder_on_the_server(server, tmp_path: Path, capsys) -> None:
    for i, text in enumerate(["Venice is built on 118 islands.", "Rome has seven hills."]):
        (tmp_path / f"{i}.txt").write_text(text)
    argv = ["warm", str(tmp_path), "--server", server.root, "--api-key", KEY]
    status, out, err = run([*argv, "--system", SYSTEM], capsys)
    assert status == 0, err
    assert "warmed 2 files into 2 passages" in out and "2 new, 0 already cached" in out
    status, out, _ = run([*argv, "--system", SYSTEM], capsys)
    assert status == 0 and "0 new, 2 already cached" in out


def test_the_cli_says_in_one_line_when_the_server_refuses(server, tmp_path, capsys) -> None:
    (tmp_path / "a.txt").write_text("A passage.")
    status, _, err = run(["warm", str(tmp_path), "--server", server.root, "--api-key", "x"], capsys)
    assert status == 1 and "refused the warm (401)" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("flags", "status", "says"),
    [
        (["--server", "http://127.0.0.1:9"], 1, "cannot reach a kvboost-rag server"),
        (["--server", "127.0.0.1:8000"], 2, "must be an http:// or https:// URL"),
        (["--server", "http://127.0.0.1:9", "--cache-dir", "c"], 2, "--server warms"),
        (["--api-key", "k", "--cache-dir", "c"], 2, "--api-key is --server's key"),
    ],
)
def test_the_cli_refuses_in_one_line(flags, status, says, tmp_path, capsys) -> None:
    (tmp_path / "a.txt").write_text("A passage.")
    got, _, err = run(["warm", str(tmp_path), *flags], capsys)
    assert got == status and says in err and err.count("\n") == 1, err
