"""What the model itself answers at an agent's second step, without the engine: each task's
right call and the tool's result in the model's own message format (arguments as a dict, a
``tool`` message), through its tokenizer's chat template, answered greedily by transformers'
``generate``. Right when the answer holds the tool's answer and no call (bare, fenced or in
tags). Where this fails, agents on the engine fail at that step too: the model calls again.

    python -m benchmarks.tools.reference --model qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from benchmarks.tools.tasks import FUNCTIONS, SPECS, SYSTEM, TASKS, ToolTask
from kvboost_rag.cli.arguments import ArgumentParser, dtype_name, positive

CALL_STARTS = ("{", "[", "```", "<tool_call>")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m benchmarks.tools.reference", description=__doc__)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16", type=dtype_name)
    parser.add_argument("--limit", type=positive, default=None, help="the first N tasks")
    parser.add_argument("--max-tokens", type=positive, default=48)
    return parser.parse_args(argv)


def step_two(task: ToolTask) -> list[dict[str, Any]]:
    """The conversation after the right call ran, its result as text."""
    result = {f.__name__: f for f in FUNCTIONS}[task.tool](**task.arguments)
    call = {"type": "function", "function": {"name": task.tool, "arguments": task.arguments}}
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task.question},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": str(result)},
    ]


def answer(model: Any, tokenizer: Any, task: ToolTask, max_tokens: int) -> str:
    ids = tokenizer.apply_chat_template(
        step_two(task),
        tools=SPECS,
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False)
    return str(tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))


def answered(task: ToolTask, text: str) -> bool:
    """The tool's answer, not another call."""
    return task.right_answer(text) and not text.lstrip().startswith(CALL_STARTS)


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvboost_rag.core.model.loading import resolve_model_path

    args = parse_args(argv)
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    right = 0
    tasks = TASKS[: args.limit]
    for task in tasks:
        text = answer(model, tokenizer, task, args.max_tokens)
        ok = answered(task, text)
        right += ok
        print(json.dumps({"question": task.question, "right": ok, "answer": text}), flush=True)
    print(
        f"{args.model} ({args.dtype}): right answers after the tool's result {right}/{len(tasks)}"
    )


if __name__ == "__main__":
    main()
