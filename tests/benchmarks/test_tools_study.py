"""The tool benchmark's pure parts: what a right call and answer are, the tools' answers,
the summary and the table; and one route end to end on a tiny model."""

from __future__ import annotations

from families import family_engine

from benchmarks.tools.routes import ROUTES
from benchmarks.tools.run import Steps, attempt, summary, table
from benchmarks.tools.tasks import (
    KINDS,
    PASSAGE_TASKS,
    SPECS,
    TASKS,
    TWO_CALL_TASKS,
    ToolTask,
    get_weather,
    multiply,
    order_status,
)
from kvboost_rag.core.tools.formats import tool_name

TASK = ToolTask("What is 12 times 7?", "multiply", {"a": 12, "b": 7}, ("84",))


def test_a_right_call_names_the_tool_with_equal_arguments() -> None:
    assert TASK.right_call("multiply", {"a": 12.0, "b": "7"})
    assert TASK.right_call("multiply", {"a": 7, "b": 12})  # the same product
    assert not TASK.right_call("multiply", {"a": 12, "b": 8})
    assert not TASK.right_call("multiply", {"a": 12, "b": 7, "c": 1})
    assert not TASK.right_call("get_weather", {"a": 12, "b": 7})
    city = ToolTask("?", "get_weather", {"city": "Paris"}, ("18",))
    assert city.right_call("get_weather", {"city": " paris"})


def test_a_right_answer_holds_one_of_the_answers() -> None:
    assert TASK.right_answer("12 times 7 is 84.")
    assert not TASK.right_answer("It is 74.")
    assert not TASK.right_answer("Is it 84?")  # a question answers nothing


def test_the_tools_answer_what_the_tasks_expect() -> None:
    assert "tuesday" in order_status(" a17").lower() and "no order" in order_status("Z1")
    assert "18" in get_weather("paris") and "-3" in get_weather("Oslo, Norway")
    assert {tool_name(s) for s in SPECS} == {t.tool for t in TASKS}


def test_each_later_call_reads_its_arguments_from_the_result_before_it() -> None:
    tools = {"multiply": multiply, "order_status": order_status, "get_weather": get_weather}
    assert {t.kind for t in TWO_CALL_TASKS} == {"two calls"} and len(TWO_CALL_TASKS) >= 6
    for task in TWO_CALL_TASKS:
        first = str(tools[task.tool](**task.arguments))
        ((name, arguments),) = task.then
        assert all(str(v) in first for v in arguments.values() if name == "get_weather")
        if name == "multiply":
            assert float(first) == arguments["a"]
        assert task.right_answer(str(tools[name](**arguments)))


def test_a_passage_task_sends_its_passage_and_a_distractor_before_the_question() -> None:
    task = PASSAGE_TASKS[0]
    assert task.kind == "call + passage" and len(task.passages) == 2
    assert task.prompt.startswith(f"Context:\n{task.passages[0]}\n\n{task.passages[1]}")
    assert task.prompt.endswith(f"Question: {task.question}") and TASK.prompt == TASK.question
    assert "B42" in task.passages[0] and task.arguments == {"order_id": "B42"}
    assert set(KINDS) == {"one call", "two calls", "call + passage"}


def test_summary_and_table_count_right_answers_errors_and_later_reuse() -> None:
    records = [
        {"right": True, "tools_run": ["multiply"], "invalid": 0, "error": None, "seconds": 2.0},
        {"right": False, "tools_run": [], "invalid": 1, "error": "ValueError: x", "seconds": 4.0},
    ]
    records[0]["reused"] = [0.0, 0.9, 0.75]  # the first step's share is not counted
    s = summary(records, [TASK, TASK])
    assert (s["right"], s["right_tool_first"], s["invalid_calls"], s["errors"]) == (1, 1, 1, 1)
    assert (s["later_steps"], s["later_steps_80"], s["least_later_reuse"]) == (2, 1, 0.75)
    report = {
        "model": "m",
        "machine": {"dtype": "bfloat16", "cpu": "cpu"},
        "routes": {"engine auto": {"summary": s}},
    }
    assert "| engine auto | 1/2 | 1/2 | 1 | 0 | 1 | 1/2 | 75% | 4.0 |" in table(report)


def test_a_route_that_raises_is_counted_not_raised() -> None:
    def broken(engine, task, max_tokens):  # type: ignore[no-untyped-def]
        raise RuntimeError("constrained decoding failed")

    record = attempt(broken, None, TASK, 8)  # type: ignore[arg-type]
    assert record["right"] is False and record["error"].startswith("RuntimeError")


def test_the_forced_engine_route_runs_on_a_tiny_model() -> None:
    """A random model's numbers run on, so its call is cut: scored, reported, not raised;
    its one step's reuse is read from the engine's answer."""
    engine = family_engine("qwen2.5")
    record = attempt(ROUTES["engine forced"], engine, TASK, 24)
    assert record["error"] is None and record["right"] is False
    assert record["tools_run"] or record["invalid"] == 1
    assert len(record["reused"]) == 1 and 0.0 <= record["reused"][0] <= 1.0
    assert "chat" not in vars(engine)  # the recorder is gone after the task


def test_steps_read_each_answer_chat_and_stream_chat_made() -> None:
    engine = family_engine("qwen2.5")
    messages = [{"role": "user", "content": "Hi there"}]
    with Steps(engine) as steps:
        first = engine.chat(messages, max_new_tokens=2)
        list(engine.stream_chat(messages, max_new_tokens=2))
    shares = steps.reused()
    assert len(shares) == 2 and shares[0] == first.reused_tokens / first.prompt_tokens
    assert shares[1] > 0  # the same prompt again: its prefix is read from the cache


def test_the_generate_loop_runs_on_a_tiny_model() -> None:
    """The model alone: its answer parsed plainly, a loop that ends with text or at the
    limit, scored and not raised; no engine answer, so no reuse counted."""
    record = attempt(ROUTES["generate loop"], family_engine("qwen2.5"), TASK, 8)
    assert record["error"] is None and record["right"] is False and record["reused"] == []


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
    model's answer is scored, not raised, and the loop ends within its steps; each step
    the server answered (through ``stream_chat``) has its reuse read."""
    from benchmarks.tools.routes import LOOP_STEPS

    record = attempt(ROUTES["openai loop"], family_engine("qwen2.5"), TASK, 24)
    assert record["error"] is None and record["right"] is False
    assert 1 <= record["steps"] <= LOOP_STEPS
    assert record["limited"] == (record["steps"] == LOOP_STEPS and not record["final"])
    assert len(record["reused"]) == record["steps"]


def test_a_record_is_its_report_and_its_table(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from benchmarks.common.records import write_record

    write_record(tmp_path / "out", "tools-m", {"model": "m"}, "| a |")
    assert json.loads((tmp_path / "out" / "tools-m.json").read_text()) == {"model": "m"}
    assert (tmp_path / "out" / "tools-m.txt").read_text() == "| a |\n"
