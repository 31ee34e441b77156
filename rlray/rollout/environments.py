"""Environments: what answers the policy between its turns in a multi-turn rollout.

The protocol (rlray.core.environment; one instance per trajectory, driven by
rlray.rollout.multiturn):

    reset(row) -> str            the first observation, appended to the prompt ("" for none)
    step(action) -> StepResult   the model's turn text in; observation, reward, done out
    take_spans() -> list[Span]   optional: the spans recorded since the last call

Either method may be `async def`. An async caller awaits `maybe_await(env.step(text))`;
a caller in a thread uses `rlray.rollout.multiturn.call_maybe_async(env.step, text)`, which runs
each call in a fresh event loop (so an async environment must not keep loop-bound
objects, such as an aiohttp session, from one call to the next).

Limits: `TurnLimited(env, max_turns)` is where an environment's own turn limit lives:
at its last turn it ends the episode (done) with that turn's reward. The token budget
belongs to the rollout loop, which alone counts tokens (`TurnLimits.max_completion_tokens`),
and so does its hard cap on model turns (`TurnLimits.max_turns`, finish reason 'length').

Observations are text in the model's chat format, since the loop appends their tokens
as they are: `qwen_user_turn` and `qwen_tool_turn` follow the Qwen2.5 chat template and
assume the model's turn ended with its `<|im_end|>` token (vLLM keeps the stop token's id).

Spans: an environment that calls tools keeps a `tool_call` Span per call (name, arguments
as JSON text, result or error, start and end) and hands them over in `take_spans()`.
Reward spans are the loop's: it records one for every StepResult whose reward is not None
(source 'environment'), so environments here record none, and none is counted twice.

Built-ins:
    ToolEnvironment       tool calls in the Hermes/Qwen `<tool_call>` format, answered
                          with `<tool_response>`; a turn without a call is the final answer
    TryAgainEnvironment   says a wrong answer is wrong and lets the model try again
    tool_success          reward: the share of an episode's tool calls that ran without error
"""

from __future__ import annotations

import inspect
import json
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlray.config import BUILTIN_CALCULATOR, ConfigError
from rlray.core.environment import StepResult, row_columns, take_spans
from rlray.core.episode import Span
from rlray.core.prompt import PromptRow
from rlray.data.calculator import calculate
from rlray.rewards.loading import import_attribute
from rlray.rewards.text import normalized_match, numeric_match
from rlray.rollout.tools import CALCULATOR, Tool, call_tool


class TurnLimited:
    """`environment`, ended (done) at its max_turns-th step with that step's reward.

    The one place an environment's turn limit is enforced; plain or async environments
    alike (then step returns a coroutine)."""

    def __init__(self, environment: Any, max_turns: int):
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        self.environment = environment
        self.max_turns = max_turns
        self.turns = 0

    def reset(self, row: Any) -> str | Awaitable[str]:
        self.turns = 0
        return self.environment.reset(row)

    def step(self, action: str) -> StepResult | Awaitable[StepResult]:
        self.turns += 1
        result = self.environment.step(action)
        if inspect.isawaitable(result):
            return self._limited_when_done(result)
        return self._limited(result)

    def take_spans(self) -> list[Span]:
        return take_spans(self.environment)

    async def _limited_when_done(self, pending: Awaitable[StepResult]) -> StepResult:
        return self._limited(await pending)

    def _limited(self, result: StepResult) -> StepResult:
        if result.done or self.turns < self.max_turns:
            return result
        return StepResult("", result.reward, True)


# ---------------------------------------------------------------- chat framing


def qwen_user_turn(content: str) -> str:
    """Returns content as a Qwen2.5 (ChatML) user turn after the model's `<|im_end|>`,
    followed by the header of the model's next turn."""
    return f"\n<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


def qwen_tool_turn(responses: list[str]) -> str:
    """Returns tool results as the Qwen2.5 chat template renders consecutive `tool`
    messages (one user turn, a `<tool_response>` block each), then the model's header."""
    blocks = "".join(f"\n<tool_response>\n{response}\n</tool_response>" for response in responses)
    return f"\n<|im_start|>user{blocks}<|im_end|>\n<|im_start|>assistant\n"


def plain_turn(content: str) -> str:
    """Returns content on lines of its own: the framing for a model without a chat template."""
    return f"\n{content}\n"


# ---------------------------------------------------------------- tool calls

# A call's JSON between the tags, as Qwen2.5's template writes it:
# <tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>
# A call cut off by the token limit has no closing tag and runs to the end.
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.S)


@dataclass(frozen=True)
class ToolCall:
    """One `<tool_call>` block of a model turn, parsed or not."""

    text: str
    """The text between the tags."""
    name: str | None = None
    arguments: dict[str, Any] | None = None
    error: str | None = None
    """Why the block is not a call (bad JSON, wrong shape, no closing tag); None if it is."""

    @property
    def arguments_json(self) -> str:
        """Returns the arguments as JSON text (the raw block when they did not parse)."""
        if self.arguments is None:
            return self.text
        return json.dumps(self.arguments, ensure_ascii=False)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Returns the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks of a
    model turn in order, each parsed or with the reason it could not be."""
    calls = []
    for match in _TOOL_CALL.finditer(text):
        body = match[1].strip()
        if not match[2]:
            calls.append(ToolCall(body, error="<tool_call> without </tool_call>"))
        else:
            calls.append(_parse_call(body))
    return calls


def _parse_call(body: str) -> ToolCall:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall(body, error=f"bad JSON in <tool_call>: {err.msg} at character {err.pos}")
    except RecursionError:
        return ToolCall(body, error="bad JSON in <tool_call>: nested too deeply")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCall(body, error='expected {"name": "<tool>", "arguments": {...}}')
    arguments = data.get("arguments", {})  # a tool without parameters may omit them
    if not isinstance(arguments, dict):
        return ToolCall(body, name=data["name"], error="arguments must be a JSON object")
    return ToolCall(body, name=data["name"], arguments=arguments)


@dataclass
class ToolEnvironment:
    """Answers each `<tool_call>` of a model turn with its tool's `<tool_response>`; a turn
    without a call ends the episode when it is a final answer (see final_answer).

    Every call, good or bad, leaves a tool_call span; every failure (bad JSON, unknown
    tool, invalid arguments, exception, timeout) is shown to the model as `Error: ...`.
    Rewards: None at every step; reward functions score the finished episode."""

    tools: Sequence[Tool] = (CALCULATOR,)
    """The tools it answers (names unique); the calculator alone by default, so that
    `rlray.rollout.environments:ToolEnvironment` can be named where a class is built per
    trajectory."""
    final_answer: re.Pattern[str] | None = None
    """A turn without a tool call is the final answer (done) if this pattern is found in
    it; None: every such turn is. Otherwise the model is told `nudge` and goes on."""
    nudge: str = "Call a tool, or give your final answer."
    max_calls_per_turn: int = 4
    """Calls beyond this many in one turn are not run (each an error span)."""
    max_response_chars: int = 2000
    """A tool result or error is cut to this many characters: it costs context tokens."""
    tool_turn: Callable[[list[str]], str] = qwen_tool_turn
    user_turn: Callable[[str], str] = qwen_user_turn
    spans: list[Span] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.by_name = {tool.name: tool for tool in self.tools}
        if len(self.by_name) != len(self.tools):
            raise ValueError(f"tool names repeat: {[tool.name for tool in self.tools]}")

    def reset(self, row: Any) -> str:
        self.spans = []
        return ""

    def step(self, action: str) -> StepResult:
        calls = parse_tool_calls(action)
        if not calls:
            if self.final_answer is None or self.final_answer.search(action):
                return StepResult("", None, True)
            return StepResult(self.user_turn(self.nudge), None, False)
        responses = [self._respond(call, index) for index, call in enumerate(calls)]
        return StepResult(self.tool_turn(responses), None, False)

    def take_spans(self) -> list[Span]:
        """Returns the spans recorded since the last call (the rollout collects them)."""
        spans, self.spans = self.spans, []
        return spans

    def _respond(self, call: ToolCall, index: int) -> str:
        span = self._call(call, index)
        if span.result is not None:
            span.result = _cut(span.result, self.max_response_chars)
        if span.error is not None:
            span.error = _cut(span.error, self.max_response_chars)
        self.spans.append(span)
        return span.result if span.error is None else f"Error: {span.error}"

    def _call(self, call: ToolCall, index: int) -> Span:
        if index >= self.max_calls_per_turn:
            return _error_span(call, f"more than {self.max_calls_per_turn} tool calls in a turn")
        if call.error is not None:
            return _error_span(call, call.error)
        tool = self.by_name.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.by_name))
            return _error_span(call, f"unknown tool {call.name!r} (tools: {known})")
        return call_tool(tool, call.arguments)


def _error_span(call: ToolCall, error: str) -> Span:
    now = time.time()
    return Span("tool_call", now, now, name=call.name, arguments=call.arguments_json, error=error)


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters]"


# ---------------------------------------------------------------- try again


def answers_match(text: str, answer: Any) -> bool:
    """Returns whether a turn gives the answer: equal after rlray's normalisation
    (normalized_match), or the same number (numeric_match: the boxed or last number)."""
    return 1.0 in (
        normalized_match([""], [text], [answer])[0],
        numeric_match([""], [text], [answer])[0],
    )


@dataclass
class TryAgainEnvironment:
    """Rewards the right answer (the row's `answer` column) with 1.0 and ends; says a
    wrong one is wrong (reward 0.0) and lets the model try again. Wrap it in TurnLimited
    to bound the tries."""

    feedback: str = "That is not correct. Try again."
    check: Callable[[str, Any], bool] = answers_match
    """check(turn text, answer) -> whether the turn is right."""
    user_turn: Callable[[str], str] = qwen_user_turn
    answer: Any = None

    def reset(self, row: Any) -> str:
        columns = row_columns(row)
        if "answer" not in columns:
            raise KeyError("TryAgainEnvironment needs an 'answer' column")
        self.answer = columns["answer"]
        return ""

    def step(self, action: str) -> StepResult:
        if self.check(action, self.answer):
            return StepResult("", 1.0, True)
        return StepResult(self.user_turn(self.feedback), 0.0, False)


@dataclass
class CalculatorEnvironment:
    """One trajectory of the task: calculator calls answered, the final answer scored."""

    answer: str = ""
    spans: list[Span] = field(default_factory=list)

    def reset(self, row: PromptRow) -> str:
        self.answer = str(row.columns["answer"])
        return ""

    def step(self, action: str) -> StepResult:
        text = action.strip()
        if text.startswith("("):
            return self._call(text)
        return StepResult("", float(text == self.answer), True)

    def _call(self, text: str) -> StepResult:
        started = time.time()
        value = calculate(text)
        error = None if value is not None else f"not a calculator call: {text!r}"
        self.spans.append(
            Span(
                "tool_call",
                started,
                time.time(),
                name="calculator",
                arguments=json.dumps({"expression": text}),
                result=None if value is None else str(value),
                error=error,
            )
        )
        # A malformed call gets '=' alone: the model answers without a result. A call
        # earns 0, so that an episode cut off by the turn limit has a reward too.
        return StepResult(f"{'' if value is None else value}=", 0.0, False)

    def take_spans(self) -> list[Span]:
        """Returns the spans recorded since the last call (the rollout collects them)."""
        spans, self.spans = self.spans, []
        return spans


def load_environment(spec: str) -> Callable[[], Any]:
    """Returns what rollout.environment names, to be called once per trajectory:
    builtin:calculator, or a class as "module:Class" or "path/to/file.py:Class". Raises
    ConfigError with a one-line reason."""

    if spec == BUILTIN_CALCULATOR:
        return CalculatorEnvironment
    if spec.startswith("builtin:"):
        raise ConfigError(
            f"rollout.environment: unknown built-in {spec!r}; known: {BUILTIN_CALCULATOR}"
        )
    try:
        target = import_attribute(spec)
    except ValueError as err:
        raise ConfigError(f"rollout.environment: {err}") from None
    if not all(callable(getattr(target, name, None)) for name in ("reset", "step")):
        raise ConfigError(f"rollout.environment: {spec} has no reset and step methods")
    return target
