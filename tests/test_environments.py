"""Environments and tools (rlray.rollout.environments, rlray.rollout.tools): tool-call
parsing, every failure as an observation and an error span, the calculator's arithmetic
and refusals, the try-again flow under a turn limit, async environments, and the tool
reward."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import pytest

from rlray.core.environment import StepResult, maybe_await
from rlray.core.episode import Episode, Span, from_table, to_table, validate_episode
from rlray.core.prompt import PromptRow
from rlray.rewards.trace import tool_success
from rlray.rollout.environments import (
    ToolEnvironment,
    TryAgainEnvironment,
    TurnLimited,
    parse_tool_calls,
    plain_turn,
)
from rlray.rollout.multiturn import call_maybe_async
from rlray.rollout.tools import (
    CALCULATOR,
    CalculatorError,
    Tool,
    call_tool,
    evaluate_arithmetic,
    python_tool,
    schema_from_hints,
)


def call(name: str, arguments: dict | None = None) -> str:
    """Returns a tool call as Qwen2.5's chat template writes one."""
    body = {"name": name} if arguments is None else {"name": name, "arguments": arguments}
    return f"<tool_call>\n{json.dumps(body)}\n</tool_call>"


def tool_env(*tools: Tool, **options) -> ToolEnvironment:
    env = ToolEnvironment(tools, **options) if tools else ToolEnvironment(**options)
    env.reset(PromptRow("What is 12*34?", {"answer": "408"}))
    return env


def only_span(env: ToolEnvironment) -> Span:
    spans = env.take_spans()
    assert len(spans) == 1, spans
    return spans[0]


# ---------------------------------------------------------------- parsing and answers


def test_a_tool_call_is_answered_in_the_qwen_chat_format():
    env = tool_env()
    before = time.time()
    result = env.step("I will compute it.\n" + call("calculator", {"expression": "12*34"}))
    assert result == StepResult(
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
        None,
        False,
    )
    span = only_span(env)
    assert (span.kind, span.name, span.result, span.error) == (
        "tool_call",
        "calculator",
        "408",
        None,
    )
    assert json.loads(span.arguments) == {"expression": "12*34"}
    assert before <= span.started_at <= span.ended_at <= time.time()
    assert env.take_spans() == []  # taken once


def test_calls_in_one_turn_are_answered_in_order_in_one_user_turn():
    env = tool_env()
    turn = (
        call("calculator", {"expression": "1+1"}) + "\n" + call("calculator", {"expression": "2*5"})
    )
    observation = env.step(turn).observation
    assert observation == (
        "\n<|im_start|>user\n<tool_response>\n2\n</tool_response>\n<tool_response>\n10\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert [span.result for span in env.take_spans()] == ["2", "10"]


def test_bad_json_becomes_an_error_observation_and_span():
    env = tool_env()
    result = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>')
    assert not result.done
    assert "Error: bad JSON in <tool_call>" in result.observation
    span = only_span(env)
    assert span.name is None and span.result is None
    assert span.error.startswith("bad JSON")
    assert span.arguments == '{"name": "calculator", "arguments": {"expression":'  # as written


@pytest.mark.parametrize(
    "turn, error",
    [
        ("<tool_call>[1, 2]</tool_call>", 'expected {"name"'),
        ('<tool_call>{"arguments": {}}</tool_call>', 'expected {"name"'),
        ('<tool_call>{"name": "calculator", "arguments": "2+2"}</tool_call>', "JSON object"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "without"),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", "bad JSON"),
    ],
)
def test_malformed_calls_are_errors_not_crashes(turn, error):
    env = tool_env()
    assert error in env.step(turn).observation
    assert error in only_span(env).error


def test_an_unknown_tool_is_named_with_the_known_ones():
    env = tool_env()
    observation = env.step(call("search", {"query": "x"})).observation
    assert "Error: unknown tool 'search' (tools: calculator)" in observation
    span = only_span(env)
    assert span.name == "search" and json.loads(span.arguments) == {"query": "x"}


@pytest.mark.parametrize(
    "arguments, error",
    [
        ({}, "'expression' is a required property"),
        ({"expression": "1+1", "precision": 3}, "Additional properties are not allowed"),
        ({"expression": 12}, "expression: 12 is not of type 'string'"),
        (None, "'expression' is a required property"),  # "arguments" left out
    ],
)
def test_arguments_that_break_the_schema_are_refused_before_the_tool_runs(arguments, error):
    ran = []

    def calculator(expression: str) -> str:
        ran.append(expression)
        return "0"

    env = tool_env(Tool("calculator", calculator))
    observation = env.step(call("calculator", arguments)).observation
    assert f"Error: invalid arguments: {error}" in observation
    assert ran == []
    assert only_span(env).error.startswith("invalid arguments")


def test_calls_beyond_the_per_turn_limit_are_not_run():
    ran = []
    env = tool_env(Tool("note", lambda text: ran.append(text) or "ok", _TEXT_SCHEMA))
    env.max_calls_per_turn = 2
    env.step("".join(call("note", {"text": str(i)}) for i in range(3)))
    spans = env.take_spans()
    assert ran == ["0", "1"]
    assert [span.error for span in spans] == [None, None, "more than 2 tool calls in a turn"]


def test_a_turn_without_a_call_is_the_final_answer():
    result = tool_env().step("The answer is 408.")
    assert result == StepResult("", None, True)


def test_a_final_answer_pattern_makes_other_turns_a_nudge():
    env = tool_env(final_answer=re.compile(r"\\boxed\{"), user_turn=plain_turn)
    assert env.step("Let me think.") == StepResult(
        "\nCall a tool, or give your final answer.\n", None, False
    )
    assert env.step(r"So \boxed{408}.").done


# ---------------------------------------------------------------- running tools

_TEXT_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
}


def test_a_tool_that_hangs_times_out_as_an_error():
    release = threading.Event()
    slow = Tool("slow", lambda text: release.wait(30) and "late", _TEXT_SCHEMA, timeout_s=0.2)
    env = tool_env(slow)
    started = time.monotonic()
    observation = env.step(call("slow", {"text": "x"})).observation
    elapsed = time.monotonic() - started
    release.set()  # lets the abandoned thread finish
    assert elapsed < 2.0
    assert "Error: timed out after 0.2 s" in observation
    span = only_span(env)
    assert span.error == "timed out after 0.2 s" and span.result is None
    assert span.ended_at - span.started_at >= 0.2


@pytest.mark.parametrize(
    "error, shown",
    [(ValueError("boom"), "ValueError: boom"), (SystemExit(3), "RuntimeError: SystemExit(3)")],
)
def test_a_tool_that_raises_becomes_an_error_observation(error, shown):
    def failing(text: str) -> str:
        raise error

    env = tool_env(Tool("failing", failing))
    assert f"Error: {shown}" in env.step(call("failing", {"text": "x"})).observation
    assert only_span(env).error == shown


def test_tool_results_are_text_and_cut_to_the_response_limit():
    def lookup(key: str) -> dict:
        return {"key": key, "values": [1, 2]}

    assert call_tool(Tool("lookup", lookup, _KEY_SCHEMA), {"key": "a"}).result == (
        '{"key": "a", "values": [1, 2]}'
    )
    env = tool_env(Tool("long", lambda key: "x" * 50, _KEY_SCHEMA), max_response_chars=10)
    observation = env.step(call("long", {"key": "a"})).observation
    assert "\nxxxxxxxxxx... [40 more characters]\n" in observation
    assert only_span(env).result == "xxxxxxxxxx... [40 more characters]"


_KEY_SCHEMA = {"type": "object", "properties": {"key": {"type": "string"}}}


def test_an_async_tool_is_run_to_completion():
    async def fetch(key: str) -> str:
        await asyncio.sleep(0.01)
        return key.upper()

    assert call_tool(Tool("fetch", fetch), {"key": "ab"}).result == "AB"


def test_a_schema_is_derived_from_simple_type_hints_only():
    def f(a: int, b: float = 1.0, flag: bool = False, name: str = "") -> str:
        """Does f."""
        return ""

    schema = schema_from_hints(f)
    assert schema["required"] == ["a"]
    assert {k: v["type"] for k, v in schema["properties"].items()} == {
        "a": "integer",
        "b": "number",
        "flag": "boolean",
        "name": "string",
    }
    assert call_tool(Tool("f", f), {"a": True}).error.startswith("invalid arguments")
    assert Tool("f", f).spec()["function"] == {
        "name": "f",
        "description": "Does f.",
        "parameters": schema,
    }

    def g(items: list[int]) -> str:
        return ""

    with pytest.raises(TypeError, match="pass parameters_schema"):
        Tool("g", g)


def test_bad_schemas_and_repeated_names_fail_when_built():
    with pytest.raises(Exception, match="objekt"):
        Tool("bad", lambda: "", {"type": "objekt"})
    with pytest.raises(ValueError, match="repeat"):
        ToolEnvironment([CALCULATOR, CALCULATOR])


def test_the_python_tool_runs_code_in_the_sandbox():
    python = python_tool()
    assert call_tool(python, {"code": "print(6 * 7)"}).result == "42\n"
    failed = call_tool(python, {"code": "raise KeyError('nope')"})
    assert failed.result is None
    assert failed.error.startswith("RuntimeError: exit status 1")
    assert "KeyError: 'nope'" in failed.error


# ---------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    "expression, value",
    [
        ("2+3*4", 14),
        ("(2+3)*4", 20),
        ("7/2", 3.5),
        ("7//2", 3),
        ("-7 % 3", 2),
        ("2**10", 1024),
        ("-2**2", -4),
        ("2**-1", 0.5),
        ("1.5*4", 6.0),
        (" 10**100 + 1 ", 10**100 + 1),
    ],
)
def test_the_calculator_does_arithmetic(expression, value):
    result = evaluate_arithmetic(expression)
    assert result == value and type(result) is type(value)


@pytest.mark.parametrize(
    "expression, error",
    [
        ("x + 1", "not allowed in arithmetic: Name"),
        ("__import__('os').system('true')", "not allowed in arithmetic: Call"),
        ("(1).real", "not allowed in arithmetic: Attribute"),
        ("().__class__", "not allowed in arithmetic: Attribute"),
        ("'a' * 3", "not a number: 'a'"),
        ("True + 1", "not a number: True"),
        ("1j * 2", "not a number: 1j"),
        ("1 << 5", "operator not allowed: LShift"),
        ("~1", "operator not allowed: Invert"),
        ("9**9**9", "more than 1000 digits"),
        ("10**1001", "more than 1000 digits"),
        ("(10**600) * (10**600)", "more than 1000 digits"),
        ("2.0**5000", "result too large"),
        ("1e308 * 10", "result too large"),
        ("(-8) ** 0.5", "complex result"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("1 +", "not an arithmetic expression"),
        ("(" * 300 + "1" + ")" * 300, "longer than 500 characters"),
        ("(" * 240 + "1" + ")" * 240, "not an arithmetic expression"),
    ],
)
def test_the_calculator_refuses_anything_else_quickly(expression, error):
    started = time.monotonic()
    with pytest.raises(CalculatorError, match=re.escape(error)):
        evaluate_arithmetic(expression)
    assert time.monotonic() - started < 0.5  # refused before it is computed


def test_a_calculator_refusal_reaches_the_model_as_an_error():
    env = tool_env()
    observation = env.step(call("calculator", {"expression": "9**9**9"})).observation
    assert "Error: CalculatorError: result would have more than 1000 digits" in observation


# ---------------------------------------------------------------- try again and limits

ROW = PromptRow("What is 2+2?", {"answer": "4"})


def test_try_again_says_wrong_until_the_answer_is_right():
    env = TurnLimited(TryAgainEnvironment(), max_turns=3)
    assert env.reset(ROW) == ""
    wrong = env.step("5")
    assert wrong == StepResult(
        "\n<|im_start|>user\nThat is not correct. Try again.<|im_end|>\n<|im_start|>assistant\n",
        0.0,
        False,
    )
    assert env.step("The answer is \\boxed{4}.") == StepResult("", 1.0, True)


def test_the_turn_limit_ends_the_episode_with_the_last_reward():
    env = TurnLimited(TryAgainEnvironment(user_turn=plain_turn), max_turns=2)
    env.reset(ROW)
    assert not env.step("3").done
    assert env.step("5") == StepResult("", 0.0, True)
    env.reset(ROW)  # a reset starts the count again
    assert env.step("3") == StepResult("\nThat is not correct. Try again.\n", 0.0, False)


def test_try_again_needs_an_answer_and_a_turn_limit_needs_a_turn():
    with pytest.raises(KeyError, match="answer"):
        TryAgainEnvironment().reset(PromptRow("2+2=", {}))
    with pytest.raises(ValueError, match="at least 1"):
        TurnLimited(TryAgainEnvironment(), max_turns=0)


class AsyncCountdown:
    """An async environment that answers 'again' and never ends by itself."""

    async def reset(self, row: PromptRow) -> str:
        await asyncio.sleep(0)
        return f"[{row.columns['answer']}]"

    async def step(self, action: str) -> StepResult:
        await asyncio.sleep(0)
        return StepResult("again", 0.5, False)


def test_async_environments_step_through_the_helpers_and_the_turn_limit():
    env = TurnLimited(AsyncCountdown(), max_turns=2)

    async def episode() -> list[StepResult]:
        assert await maybe_await(env.reset(ROW)) == "[4]"
        return [await maybe_await(env.step("x")) for _ in range(2)]

    assert asyncio.run(episode()) == [StepResult("again", 0.5, False), StepResult("", 0.5, True)]
    assert asyncio.run(maybe_await(StepResult("plain", None, True))).observation == "plain"
    # The rollout loop's thread helper runs the same environment.
    assert call_maybe_async(env.reset, ROW) == "[4]"
    assert call_maybe_async(env.step, "x") == StepResult("again", 0.5, False)
    assert call_maybe_async(env.step, "x").done
    assert env.take_spans() == []


# ---------------------------------------------------------------- spans and the reward


def test_tool_success_is_the_share_of_calls_without_error():
    env = tool_env()
    env.step(call("calculator", {"expression": "1+1"}) + call("calculator", {"expression": "1/0"}))
    env.step(call("calculator", {"expression": "3*3"}))
    spans = env.take_spans()
    spans.append(Span("reward", 0.0, 0.0, value=1.0, source="environment"))  # not a call
    as_dicts = [json.loads(json.dumps(span.__dict__)) for span in spans]
    scores = tool_success(["p"] * 3, ["c"] * 3, spans=[spans, as_dicts, []])
    assert scores == pytest.approx([2 / 3, 2 / 3, 0.0])
    assert tool_success(["p"], ["c"], spans=[[]], no_calls=None) == [None]
    with pytest.raises(ValueError, match="spans"):
        tool_success(["p"], ["c"])


def test_tool_spans_fit_the_episode_schema():
    env = tool_env()
    env.step(call("calculator", {"expression": "6*7"}) + "<tool_call>{oops</tool_call>")
    episode = Episode(
        run_id="r",
        episode_id="r-0-0",
        prompt_index=0,
        sample_index=0,
        prompt="p",
        completion="c",
        prompt_token_ids=[1],
        completion_token_ids=[2],
        rollout_logprobs=[-0.1],
        finish_reason="stop",
        policy_version=0,
        rollout_worker="rollout-0",
        spans=env.take_spans(),
    )
    validate_episode(episode)
    (back,) = from_table(to_table([episode]))
    assert [(s.name, s.result, s.error is None) for s in back.spans] == [
        ("calculator", "42", True),
        (None, None, False),
    ]
    assert back.spans[1].arguments == "{oops"


def test_parse_tool_calls_reads_every_block():
    calls = parse_tool_calls(
        "a " + call("calculator", {"expression": "1"}) + " b " + call("noargs") + " c"
    )
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "1"}, None),
        ("noargs", {}, None),
    ]
    assert parse_tool_calls("no call here") == []
