"""The tool benchmark's pure parts: what a right call and answer are, the tools' answers,
the summary and the table; and one route end to end on a tiny model."""

from __future__ import annotations

from families import family_engine

from benchmarks.tools.routes import ROUTES
from benchmarks.tools.run import attempt, summary, table
from benchmarks.tools.tasks import SPECS, TASKS, ToolTask, get_weather, order_status
from kvboost_rag.core.tools.formats import tool_name

TASK = ToolTask("What is 12 times 7?", "multiply", {"a": 12, "b": 7}, ("84",))


def test_a_right_call_names_the_tool_with_equal_arguments() -> None:
    assert TASK.right_call("multiply", {"a": 12.0, "b": "7"})
    assert not TASK.right_call("multiply", {"a": 12, "b": 8})
    assert not TASK.right_call("multiply", {"a": 12, "b": 7, "c": 1})
    assert not TASK.right_call("get_weather", {"a": 12, "b": 7})
    city = ToolTask("?", "get_weather", {"city": "Paris"}, ("18",))
    assert city.right_call("get_weather", {"city": " paris"})


def test_a_right_answer_holds_one_of_the_answers() -> None:
    assert TASK.right_answer("12 times 7 is 84.")
    assert not TASK.right_answer("It is 74.")


def test_the_tools_answer_what_the_tasks_expect() -> None:
    assert "tuesday" in order_status(" a17").lower() and "no order" in order_status("Z1")
    assert "18" in get_weather("paris")
    assert {tool_name(s) for s in SPECS} == {t.tool for t in TASKS}


def test_summary_and_table_count_right_answers_and_errors() -> None:
    records = [
        {"right": True, "tools_run": ["multiply"], "invalid": 0, "error": None, "seconds": 2.0},
        {"right": False, "tools_run": [], "invalid": 1, "error": "ValueError: x", "seconds": 4.0},
    ]
    s = summary(records, [TASK, TASK])
    assert (s["right"], s["right_tool_first"], s["invalid_calls"], s["errors"]) == (1, 1, 1, 1)
    report = {
        "model": "m",
        "machine": {"dtype": "bfloat16", "cpu": "cpu"},
        "routes": {"engine auto": {"summary": s}},
    }
    assert "| engine auto | 1/2 | 1/2 | 1 | 0 | 1 | 4.0 |" in table(report)


def test_a_route_that_raises_is_counted_not_raised() -> None:
    def broken(engine, task, max_tokens):  # type: ignore[no-untyped-def]
        raise RuntimeError("constrained decoding failed")

    record = attempt(broken, None, TASK, 8)  # type: ignore[arg-type]
    assert record["right"] is False and record["error"].startswith("RuntimeError")


def test_the_forced_engine_route_runs_on_a_tiny_model() -> None:
    """A random model's numbers run on, so its call is cut: scored, reported, not raised."""
    record = attempt(ROUTES["engine forced"], family_engine("qwen2.5"), TASK, 24)
    assert record["error"] is None and record["right"] is False
    assert record["tools_run"] or record["invalid"] == 1


def test_the_reference_step_renders_the_call_and_result_in_qwens_tags() -> None:
    from families import family_tokenizer

    from benchmarks.tools.reference import answered, step_two

    text = family_tokenizer("qwen2.5").apply_chat_template(
        step_two(TASK), tools=SPECS, tokenize=False, add_generation_prompt=True
    )
    call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 7}}\n</tool_call>'
    assert call in text and text.endswith(
        "<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert answered(TASK, "12 times 7 is 84.")
    assert not answered(TASK, '{"name": "multiply", "arguments": {"a": 84, "b": 1}}')


def test_the_openai_loop_runs_against_the_servers_app_on_a_tiny_model() -> None:
    """The real ``openai`` client against the server's app on a local port: a random
    model's answer is scored, not raised, and the loop ends within its steps."""
    from benchmarks.tools.openai_loop import STEPS

    record = attempt(ROUTES["openai loop"], family_engine("qwen2.5"), TASK, 24)
    assert record["error"] is None and record["right"] is False
    assert 1 <= record["steps"] <= STEPS
    assert record["limited"] == (record["steps"] == STEPS and not record["final"])


def test_a_record_is_its_report_and_its_table(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from benchmarks.common.records import write_record

    write_record(tmp_path / "out", "tools-m", {"model": "m"}, "| a |")
    assert json.loads((tmp_path / "out" / "tools-m.json").read_text()) == {"model": "m"}
    assert (tmp_path / "out" / "tools-m.txt").read_text() == "| a |\n"
