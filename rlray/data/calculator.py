"""The calculator task's format: two-digit multiplication with a calculator tool.

The embedded model's size cannot multiply two-digit numbers, but it can copy. A policy
turn that is a parenthesised expression, `(12*34)`, calls the calculator; the
environment (rlray.rollout.environments.CalculatorEnvironment) answers with the result
and `=` (`408=`), and the model's next turn is its answer. A turn without a call is the
final answer, and it earns reward 1 if it is the product. (The embedded tokenizer has
only digits, `+-*=()` and space, so the tool-call format is built from those; models
with a chat template use ToolEnvironment's <tool_call> blocks.)

The tiny calculator model (rlray.data.tiny_models) is the embedded architecture
warm-started on demonstrations of this format: it answers directly most of the time,
mostly wrong, and calls the calculator on one sample in ten, so RL has something to find.
"""

from __future__ import annotations

import re

TOOL_CALL = re.compile(r"^\(([0-9]{1,3})([*+\-])([0-9]{1,3})\)$")
"""A calculator call: one operation on two numbers of at most three digits."""


def calculate(call: str) -> int | None:
    """Returns the value of a calculator call such as '(12*34)', or None if the text is
    not one."""
    match = TOOL_CALL.match(call.strip())
    if match is None:
        return None
    a, operation, b = int(match[1]), match[2], int(match[3])
    return {"*": a * b, "+": a + b, "-": a - b}[operation]


def demonstration(a: int, b: int, use_tool: bool) -> list[tuple[str, bool]]:
    """Returns a worked trajectory of a*b as (text, trained) pieces after the prompt:
    the model's turns are trained on, the calculator's answer is not."""
    if use_tool:
        return [
            (f"({a}*{b})", True),
            ("<eos>", True),
            (f"{a * b}=", False),
            (str(a * b), True),
            ("<eos>", True),
        ]
    return [(str(a * b), True), ("<eos>", True)]
