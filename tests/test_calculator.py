"""The built-in calculator task's parts, without vLLM: the tool-call format, the
environment's answers and spans, the prompts, loading environments by name, and the
environment_reward built-in."""

from __future__ import annotations

import json

import pytest

from rlray.config import ConfigError
from rlray.core.episode import Span
from rlray.data.calculator import calculate, demonstration
from rlray.data.tasks import MULTIPLICATION, TaskPrompts, addition
from rlray.rewards.trace import environment_reward
from rlray.rollout.environments import CalculatorEnvironment, load_environment


@pytest.mark.parametrize(
    ("call", "value"),
    [("(12*34)", 408), (" (7+5) ", 12), ("(3-10)", -7), ("(999*999)", 998001)],
)
def test_calculator_calls_are_computed(call, value):
    assert calculate(call) == value


@pytest.mark.parametrize("text", ["12*34", "(12*)", "(1234*5)", "(1*2*3)", "(2**9)", "()"])
def test_other_text_is_not_a_calculator_call(text):
    assert calculate(text) is None


def test_a_tool_call_is_answered_with_its_result_and_recorded():
    environment = CalculatorEnvironment()
    assert environment.reset(MULTIPLICATION.row(12, 34)) == ""
    result = environment.step("(12*34)")
    assert (result.observation, result.reward, result.done) == ("408=", 0.0, False)
    (span,) = environment.take_spans()
    assert (span.kind, span.name, span.result, span.error) == (
        "tool_call",
        "calculator",
        "408",
        None,
    )
    assert json.loads(span.arguments) == {"expression": "(12*34)"}
    assert environment.take_spans() == []  # each span is handed over once


def test_a_malformed_call_gets_no_result_and_an_error_span():
    environment = CalculatorEnvironment()
    environment.reset(MULTIPLICATION.row(12, 34))
    result = environment.step("(12*")
    assert (result.observation, result.done) == ("=", False)
    (span,) = environment.take_spans()
    assert span.result is None and "not a calculator call" in span.error


@pytest.mark.parametrize(("answer", "reward"), [("408", 1.0), ("407", 0.0), ("4080", 0.0)])
def test_a_turn_without_a_call_is_the_final_answer(answer, reward):
    environment = CalculatorEnvironment()
    environment.reset(MULTIPLICATION.row(12, 34))
    result = environment.step(answer)
    assert (result.reward, result.done) == (reward, True)


def test_demonstrations_train_the_model_turns_only():
    assert demonstration(12, 34, use_tool=False) == [("408", True), ("<eos>", True)]
    tool = demonstration(12, 34, use_tool=True)
    assert [text for text, _ in tool] == ["(12*34)", "<eos>", "408=", "408", "<eos>"]
    assert [trained for _, trained in tool] == [True, True, False, True, True]


def test_training_prompts_never_hold_an_evaluation_pair():
    held_out = set(MULTIPLICATION.held_out_pairs(100))
    prompts = TaskPrompts(MULTIPLICATION, seed=0, held_out=100)
    rows = [prompts.row(i) for i in range(2000)]
    pairs = {tuple(int(x) for x in r.prompt.rstrip("=").split("*")) for r in rows}
    assert not pairs & held_out and len(held_out) == 100
    assert all(10 <= a < 100 and 10 <= b < 100 for a, b in pairs)
    assert rows[5] == TaskPrompts(MULTIPLICATION, seed=0, held_out=100).row(5)  # seeded
    for row in rows[:50]:
        a, b = (int(x) for x in row.prompt.rstrip("=").split("*"))
        assert row.columns["answer"] == str(a * b)


def test_held_out_pairs_and_streams_stay_what_earlier_runs_were_measured_on():
    # Drawn by rlray before its tasks shared one implementation: BENCHMARKS.md's
    # held-out accuracies are over these pairs.
    assert addition(2).held_out_pairs(4) == [(22, 86), (0, 5), (86, 88), (17, 77)]
    assert MULTIPLICATION.held_out_pairs(4) == [(83, 93), (73, 30), (32, 81), (21, 79)]
    assert TaskPrompts(addition(2), 7, 200).row(3).prompt == "99+45="
    assert TaskPrompts(MULTIPLICATION, 7, 200).row(3).prompt == "55*27="


class NoStep:
    def reset(self, row):
        return ""


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("builtin:chess", "unknown built-in 'builtin:chess'; known: builtin:calculator"),
        ("no_such_module_x:Env", "cannot import no_such_module_x"),
        ("tests.test_calculator:Missing", "has no attribute 'Missing'"),
        ("tests.test_calculator:NoStep", "has no reset and step methods"),
    ],
)
def test_a_bad_environment_name_is_a_config_error(spec, message):
    with pytest.raises(ConfigError, match="rollout.environment: .*" + message.replace("(", r"\(")):
        load_environment(spec)


def test_environments_load_by_name():
    assert load_environment("builtin:calculator") is CalculatorEnvironment
    assert (
        load_environment("rlray.environments:TryAgainEnvironment").__name__ == "TryAgainEnvironment"
    )


def test_environment_reward_sums_what_the_environment_gave():
    def reward(value, source="environment"):
        return Span("reward", 0.0, 0.0, value=value, source=source)

    traces = [[reward(0.5), reward(1.0)], [reward(2.0, source="judge")], []]
    assert environment_reward(["a", "b", "c"], spans=traces) == [1.5, None, None]
