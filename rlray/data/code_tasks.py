"""builtin:python-functions: short Python functions to write, each with the asserts
(MBPP's format) that the code_tests reward runs.

A problem is a template and a constant: `add_7(x)`, "returns x plus 7". Its question
asks for the function by name ("Write a Python function `add_7(x)` that returns x plus
7."); its tests are three asserts on inputs drawn for that problem, the expected values
worked out here by the template's own function. A fixed share of the problems (drawn
with a fixed seed, whatever the run seed) is held out for evaluation, and the training
stream never draws one of them.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlray.core.prompt import Message, PromptRow
from rlray.data.task_libraries import question_prompt

EVAL_SPLIT_SEED = 20261202  # fixed: the held-out problems do not move with the run seed
TESTS_PER_PROBLEM = 3


def _ints(rng: random.Random) -> tuple:
    return (rng.randint(-60, 60),)


def _naturals(rng: random.Random) -> tuple:
    return (rng.randint(0, 200),)


def _words(rng: random.Random) -> tuple:
    return ("".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7))),)


def _lists(rng: random.Random) -> tuple:
    return ([rng.randint(-20, 40) for _ in range(rng.randint(3, 7))],)


@dataclass(frozen=True)
class Template:
    """A family of problems, one per constant."""

    name: str
    """The function's name, "{k}" standing for the constant (add_{k})."""
    parameter: str
    description: str
    """What it returns, "{k}" standing for the constant."""
    answer: str
    """A Python expression of the parameter that is the answer: the reference solution
    returns it, and the tests' expected values are its values."""
    constants: tuple
    inputs: Callable[[random.Random], tuple]


NUMBERS = tuple(range(2, 31))
LETTERS = tuple("abcdefghij")
TEMPLATES = (
    Template("power_{k}", "x", "returns x to the power of {k}", "x ** {k}", (2, 3, 4, 5), _ints),
    Template(
        "repeat_{k}", "s", "returns the string s repeated {k} times", "s * {k}", (2, 3, 4, 5),
        _words,
    ),
    Template(
        "count_{k}", "s", "returns how many times the letter '{k}' appears in the string s",
        "s.count('{k}')", LETTERS, _words,
    ),
    Template(
        "starts_with_{k}", "s", "returns True if the string s starts with the letter '{k}', "
        "else False", "s.startswith('{k}')", LETTERS, _words,
    ),
    Template(
        "first_{k}", "xs", "returns a list of the first {k} elements of the list xs",
        "xs[:{k}]", (1, 2, 3, 4), _lists,
    ),
    Template(
        "sum_above_{k}", "xs", "returns the sum of the numbers in the list xs that are "
        "greater than {k}", "sum(x for x in xs if x > {k})", NUMBERS, _lists,
    ),
    Template(
        "count_above_{k}", "xs", "returns how many numbers in the list xs are greater than "
        "{k}", "sum(1 for x in xs if x > {k})", NUMBERS, _lists,
    ),
    Template(
        "count_multiples_of_{k}", "xs", "returns how many numbers in the list xs are "
        "multiples of {k}", "sum(1 for x in xs if x % {k} == 0)", NUMBERS, _lists,
    ),
    Template(
        "add_{k}_and_square", "x", "returns the square of x plus {k}, that is (x + {k})**2",
        "(x + {k}) ** 2", NUMBERS, _ints,
    ),
    Template(
        "digit_sum_plus_{k}", "x", "returns the sum of the decimal digits of the "
        "non-negative integer x, plus {k}", "sum(int(d) for d in str(x)) + {k}", NUMBERS,
        _naturals,
    ),
    Template(
        "drop_{k}", "s", "returns the string s without any of its letters '{k}'",
        "s.replace('{k}', '')", LETTERS, _words,
    ),
    Template(
        "last_{k}", "xs", "returns a list of the last {k} elements of the list xs",
        "xs[-{k}:]", (1, 2, 3, 4), _lists,
    ),
)  # fmt: skip


@dataclass(frozen=True)
class Problem:
    template: Template
    constant: Any

    @property
    def function(self) -> str:
        return self.template.name.format(k=self.constant)

    def question(self) -> str:
        what = self.template.description.format(k=self.constant)
        return f"Write a Python function `{self.function}({self.template.parameter})` that {what}."

    def solution(self) -> str:
        """Returns the reference solution's source."""
        answer = self.template.answer.format(k=self.constant)
        return f"def {self.function}({self.template.parameter}):\n    return {answer}\n"

    def tests(self) -> list[str]:
        """Returns its asserts, on inputs drawn from a generator seeded by the problem, the
        expected values the reference solution's (ours: run here, not sandboxed)."""
        namespace: dict[str, Any] = {}
        exec(self.solution(), namespace)
        solve = namespace[self.function]
        rng = random.Random(f"{self.function}:{EVAL_SPLIT_SEED}")
        drawn = [self.template.inputs(rng)[0] for _ in range(50 * TESTS_PER_PROBLEM)]
        cases = {repr(argument): solve(argument) for argument in drawn}
        # Expected values as varied as the draws allow: no constant passes them all.
        chosen: dict[str, Any] = {}
        for wanted_new_value in (True, False):
            for argument, expected in cases.items():
                new_value = expected not in chosen.values()
                if (
                    len(chosen) < TESTS_PER_PROBLEM
                    and argument not in chosen
                    and (new_value or not wanted_new_value)
                ):
                    chosen[argument] = expected
        return [f"assert {self.function}({a}) == {e!r}" for a, e in chosen.items()]


class PythonFunctionsTask:
    """The problems as prompts: the question put in the template, the tests as columns."""

    def __init__(self, template: list[Message]):
        self.template = template
        self.problems = [Problem(t, k) for t in TEMPLATES for k in t.constants]

    def row(self, problem: Problem) -> PromptRow:
        question = problem.question()
        columns = {"question": question, "tests": problem.tests(), "test_format": "assert"}
        return PromptRow(question_prompt(self.template, question), columns)

    def held_out(self, count: int) -> list[Problem]:
        """Returns `count` problems kept out of training (at most a third of them)."""
        shuffled = list(self.problems)
        random.Random(EVAL_SPLIT_SEED).shuffle(shuffled)
        return shuffled[: min(count, len(shuffled) // 3)]

    def held_out_rows(self, count: int) -> list[PromptRow]:
        return [self.row(problem) for problem in self.held_out(count)]

    def training_rows(self, held_out: int) -> list[PromptRow]:
        """Returns the rows of every problem but the `held_out` kept for evaluation."""
        kept_out = {problem.function for problem in self.held_out(held_out)}
        return [self.row(p) for p in self.problems if p.function not in kept_out]
