"""Tools a policy can call: plain Python callables with a name and a JSON schema.

`Tool(name, fn, parameters_schema, timeout_s)` is one tool; `call_tool(tool, arguments)`
validates the arguments against the schema (jsonschema), runs the function with a
timeout and returns a `tool_call` Span with the result or the error. Nothing a tool
does (a bad argument, an exception, a hang) raises out of `call_tool`: the environment
shows the error to the model and the span records it.

A plain tool runs in a daemon thread of its own, so that a timeout returns at once. A
thread cannot be killed: a tool that hangs keeps its thread (idle, holding no lock of
ours) until it returns. Code that may hang or harm belongs in a child process, as the
`python` tool runs it in rlray.sandbox.

Built-ins:
    calculator   arithmetic on numbers (+ - * / // % **), parsed with ast, never eval'd
    python       Python source run in rlray.sandbox; the result is its stdout
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import math
import operator
import threading
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from rlray.core.episode import Span
from rlray.sandbox.run import SandboxLimits, run_python

# Python annotations a schema can be derived from; anything else needs an explicit schema.
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}


@dataclass(frozen=True)
class Tool:
    """One callable tool: `fn(**arguments)` returns its result (str, or anything JSON)."""

    name: str
    """What the model writes in a call's "name"."""
    fn: Callable[..., Any]
    """A plain function, or an async one (run to completion in the tool's thread)."""
    parameters_schema: dict[str, Any] | None = None
    """JSON schema of the arguments object; None: derived from fn's type hints, which
    must all be str, int, float or bool (see schema_from_hints)."""
    timeout_s: float = 10.0
    """Wall-clock seconds a call may take before it counts as an error."""
    description: str = ""
    """What the tool does, for the model's prompt; empty: the first line of fn's docstring."""
    schema: dict[str, Any] = field(init=False, repr=False)
    """The arguments' JSON schema in use (given or derived), checked when the tool is made."""

    def __post_init__(self) -> None:
        schema = self.parameters_schema or schema_from_hints(self.fn)
        jsonschema.Draft202012Validator.check_schema(schema)  # a bad schema fails here, once
        object.__setattr__(self, "schema", schema)

    def spec(self) -> dict[str, Any]:
        """Returns the OpenAI-style function spec that chat templates list in the system
        prompt (`tokenizer.apply_chat_template(messages, tools=[t.spec() for t in tools])`)."""
        doc = (inspect.getdoc(self.fn) or "").split("\n", 1)[0]
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description or doc,
                "parameters": self.schema,
            },
        }


def schema_from_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """Returns the JSON schema of fn's keyword arguments: str, int, float and bool
    parameters only, required unless they have a default, no others allowed. Raises
    TypeError for any other parameter, which then needs an explicit parameters_schema."""
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required = []
    for name, parameter in inspect.signature(fn).parameters.items():
        if hints.get(name) not in _JSON_TYPES or parameter.kind in (
            parameter.VAR_POSITIONAL,
            parameter.VAR_KEYWORD,
        ):
            raise TypeError(
                f"{fn.__name__}({name}): only str, int, float and bool parameters get a "
                "derived schema; pass parameters_schema"
            )
        properties[name] = {"type": _JSON_TYPES[hints[name]]}
        if parameter.default is parameter.empty:
            required.append(name)
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


class ToolTimeout(Exception):
    """A tool call ran past its tool's timeout_s."""


def call_tool(tool: Tool, arguments: Any) -> Span:
    """Returns the tool_call span of tool(**arguments): the result as text, or the error
    (schema violation, exception, timeout) with result None. Never raises."""
    started = time.time()
    span = Span(
        "tool_call", started, name=tool.name, arguments=json.dumps(arguments, ensure_ascii=False)
    )
    problem = _argument_problem(tool, arguments)
    if problem is not None:
        span.error = f"invalid arguments: {problem}"
    else:
        try:
            span.result = _as_text(_run_with_timeout(tool, arguments))
        except ToolTimeout:
            span.error = f"timed out after {tool.timeout_s:g} s"
        except Exception as err:  # the tool's own failure is the model's observation
            span.error = f"{type(err).__name__}: {err}"
    span.ended_at = time.time()
    return span


def _argument_problem(tool: Tool, arguments: Any) -> str | None:
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(tool.schema).iter_errors(arguments)
    )
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path)
    return f"{where}: {error.message}" if where else error.message


def _run_with_timeout(tool: Tool, arguments: dict[str, Any]) -> Any:
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            value = tool.fn(**arguments)
            outcome["value"] = asyncio.run(value) if inspect.isawaitable(value) else value
        except BaseException as err:  # SystemExit too: a tool must not end its caller
            outcome["error"] = err

    thread = threading.Thread(target=run, name=f"tool-{tool.name}", daemon=True)
    thread.start()
    thread.join(tool.timeout_s)
    if thread.is_alive():
        raise ToolTimeout
    if "error" in outcome:
        error = outcome["error"]
        raise error if isinstance(error, Exception) else RuntimeError(repr(error))
    return outcome["value"]


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


# ---------------------------------------------------------------- calculator

MAX_EXPRESSION_CHARS = 500
MAX_RESULT_DIGITS = 1000
"""Integers (intermediate ones too) of more digits are refused: `9**9**9` would take
minutes and gigabytes, and no arithmetic task needs such numbers."""

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate."""


def evaluate_arithmetic(expression: str) -> int | float:
    """Returns the value of an arithmetic expression of int and float literals with
    + - * / // % ** and parentheses; raises CalculatorError for anything else (names,
    calls, attributes, strings), division by zero, or a result too large."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        return _evaluate(tree.body)
    except (SyntaxError, RecursionError, MemoryError) as err:
        raise CalculatorError(f"not an arithmetic expression: {type(err).__name__}") from None
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("result too large") from None


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _checked(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.Constant):
        raise CalculatorError(f"not a number: {node.value!r:.40}")
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        raise CalculatorError(f"operator not allowed: {type(node.op).__name__}")
    raise CalculatorError(f"not allowed in arithmetic: {type(node).__name__}")


def _check_power(base: int | float, exponent: int | float) -> None:
    # Checked before computing: the check after would come minutes too late.
    integers = isinstance(base, int) and isinstance(exponent, int)
    if integers and abs(base) > 1 and exponent * math.log10(abs(base)) > MAX_RESULT_DIGITS:
        raise CalculatorError(f"result would have more than {MAX_RESULT_DIGITS} digits")


def _checked(value: Any) -> int | float:
    if isinstance(value, complex):  # (-8) ** 0.5
        raise CalculatorError("complex result")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result too large")
    if isinstance(value, int) and value.bit_length() > MAX_RESULT_DIGITS * math.log2(10):
        raise CalculatorError(f"result has more than {MAX_RESULT_DIGITS} digits")
    return value


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression: numbers, + - * / // % ** and parentheses."""
    return str(evaluate_arithmetic(expression))


CALCULATOR = Tool("calculator", calculator, timeout_s=2.0)


# ---------------------------------------------------------------- python


def python_tool(limits: SandboxLimits | None = None) -> Tool:
    """Returns the `python` tool: runs the code argument in rlray.sandbox under `limits`
    (None: SandboxLimits' defaults); the result is its stdout, and a non-zero exit is an
    error with stderr's tail."""
    limits = limits or SandboxLimits()

    def python(code: str) -> str:
        """Runs Python code in a sandbox and returns what it printed."""
        result = run_python(code, limits)
        if result.timed_out:
            raise TimeoutError(f"code ran past {limits.timeout_s:g} s")
        if result.returncode != 0:
            raise RuntimeError(f"exit status {result.returncode}: {result.stderr[-1000:]}")
        return result.stdout

    # The sandbox kills the run at its own limit; the thread's is only a backstop.
    return Tool("python", python, timeout_s=limits.timeout_s + 5.0)
