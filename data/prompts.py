"""Prompt templates of the reference rollouts (Gen-Verse/dLLM-RL sample/trado_rl_rollout.py), rendered through the
model's own chat template.

The reference pasted raw template strings per model (and wrote `assistant<think>` without a newline, 16.22); we
build chat messages and let each tokenizer's chat template produce its special tokens, so one template serves
every family.
"""

from __future__ import annotations

from typing import Any

FENCE = "`" * 3
MATH = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
MATH_THINK = "You need to put your final answer in \\boxed{{}}. This is the problem:\n{question}"
OPTION = ("{question}\nPlease reason step by step, and put the final option (A, B, C, or D) within \\boxed{{}}.")
CODE_FUNCTION = ("{question}\nPlace your code within a single Python code block " + FENCE + "python " + FENCE
                 + ". Do not include more than one code block. ")
CODE_STDIO = ("This is the problem:\n{question}\nYou should put your code in " + FENCE + "python " + FENCE
              + ". Use input() to read input and print() to produce output in your script. ")


def prompt_messages(row: dict[str, Any], data_type: str, start_with_think: bool = False) -> tuple[list[dict], str]:
    """(chat messages, assistant prefix from the data) for a dataset row."""
    question = row["question"]
    if data_type == "math":
        text = (MATH_THINK if start_with_think else MATH).format(question=question)
    elif data_type == "option":
        text = OPTION.format(question=question)
    elif data_type == "code":
        stdio = row.get("test_method") == "stdio"
        text = (CODE_STDIO if stdio else CODE_FUNCTION).format(question=question)
    else:
        raise ValueError(f"unknown data_type {data_type!r}; expected math, option or code")
    prefix = ""
    if data_type == "code" and row.get("test_method") != "stdio":
        prefix = row.get("prefix", "") or ""
    return [{"role": "user", "content": text}], prefix


def prompt_ids(adapter: Any, row: dict[str, Any], data_type: str, start_with_think: bool = False) -> list[int]:
    """Token ids of the rendered prompt: chat template + generation prompt (+ ``<think>``) + the row's prefix.

    Dataset text (question, code prefix) is encoded as text: special-token strings in it never become special
    tokens.
    """
    messages, prefix = prompt_messages(row, data_type, start_with_think)
    ids = chat_ids(adapter, messages, start_with_think)
    if prefix:
        ids += adapter.encode_text(prefix)
    return ids


def chat_ids(adapter: Any, messages: list[dict], start_with_think: bool = False,
             add_generation_prompt: bool = True) -> list[int]:
    """Token ids of chat messages through the model's chat template (+ ``<think>``): how every prompt of eval.py
    and of the lm-eval model is rendered."""
    ids = adapter.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    if start_with_think:
        ids += adapter.tokenizer.encode("<think>\n", add_special_tokens=False)
    return ids
