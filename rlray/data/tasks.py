"""The built-in tasks: two-operand arithmetic prompts ("12+34=", "12*34=", "23-5=") with
answers.

A task draws operand pairs from a range; a fixed share of pairs is held out for
evaluation (the same whatever the run seed), and the training stream never draws one of
them. builtin:arithmetic is addition of operands below 10**data.arithmetic_digits;
builtin:multiplication is two-digit multiplication, the calculator task's
(rlray.data.calculator); builtin:countdown counts down from a two-digit number in steps
of one digit, writing every number: answers of 1 to 99 numbers (3 to 297 tokens), most
short and a few long, the long tail of lengths that reasoning tasks have.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rlray.core.prompt import PromptRow

# Fixed so that the held-out pairs do not move when the run seed changes.
EVAL_SPLIT_SEED = 20261122


@dataclass(frozen=True)
class OperandTask:
    """Prompts "a<operator>b=" over operands in [low, high), answered by the result."""

    operator: str
    """"+" or "*"."""
    low: int
    high: int
    split_salt: int
    """Told apart from other tasks' held-out draws (added to EVAL_SPLIT_SEED)."""

    def row(self, a: int, b: int) -> PromptRow:
        """Returns the prompt of a and b with its answer column."""
        answer = a + b if self.operator == "+" else a * b
        return PromptRow(prompt=f"{a}{self.operator}{b}=", columns={"answer": str(answer)})

    def draw(self, rng: random.Random) -> tuple[int, int]:
        return rng.randrange(self.low, self.high), rng.randrange(self.low, self.high)

    def pair_count(self) -> int:
        """Returns how many distinct operand pairs the task draws from."""
        return (self.high - self.low) ** 2

    def held_out_pairs(self, count: int) -> list[tuple[int, int]]:
        """Returns `count` distinct operand pairs kept out of training (at most half of
        all pairs)."""
        count = min(count, self.pair_count() // 2)
        rng = random.Random(EVAL_SPLIT_SEED + self.split_salt)
        pairs: dict[tuple[int, int], None] = {}
        while len(pairs) < count:
            pairs[self.draw(rng)] = None
        return list(pairs)

    def held_out_rows(self, count: int) -> list[PromptRow]:
        return [self.row(a, b) for a, b in self.held_out_pairs(count)]

    def longest_row(self) -> PromptRow:
        """Returns the prompt with the most characters (for the context-window check)."""
        return self.row(self.high - 1, self.high - 1)


def addition(digits: int) -> OperandTask:
    """Returns the task a+b with a, b < 10**digits (builtin:arithmetic)."""
    return OperandTask("+", 0, 10**digits, split_salt=digits)


MULTIPLICATION = OperandTask("*", 10, 100, split_salt=1)
"""Two-digit a*b (builtin:multiplication, the calculator task's)."""


@dataclass(frozen=True)
class CountdownTask(OperandTask):
    """Prompts "a-k=" (a in [low, high), k in [step_low, step_high)), answered by every
    number of the countdown from a in steps of k while it stays >= 0, space-separated:
    "23-5=" is answered "18 13 08 03". Exact match needs every number right."""

    step_low: int = 1
    step_high: int = 10

    def row(self, a: int, b: int) -> PromptRow:
        return PromptRow(prompt=f"{a}-{b}=", columns={"answer": countdown(a, b)})

    def draw(self, rng: random.Random) -> tuple[int, int]:
        return rng.randrange(self.low, self.high), rng.randrange(self.step_low, self.step_high)

    def pair_count(self) -> int:
        return (self.high - self.low) * (self.step_high - self.step_low)

    def longest_row(self) -> PromptRow:
        return self.row(self.high - 1, self.step_low)


def countdown(a: int, k: int) -> str:
    """Returns the countdown from a in steps of k, a itself left out, each number in two
    digits: "18 13 08 03" for 23, 5. Two digits each keep every digit three tokens after
    the one it is computed from, a fixed distance that a 2-layer model learns; numbers
    written as they are put it at varying distances, which its warm start learned far
    more slowly."""
    return " ".join(f"{n:02d}" for n in range(a - k, -1, -k))


COUNTDOWN = CountdownTask("-", 10, 100, split_salt=2)
"""builtin:countdown: a two-digit start, a one-digit step (1 to 99 numbers)."""


class TaskPrompts:
    """A task's endless training stream, seeded by the run: row(i) is the same in every
    run of one seed, and never a held-out pair."""

    def __init__(self, task: OperandTask, seed: int, held_out: int):
        self.task = task
        self.seed = seed
        self.held_out = set(task.held_out_pairs(held_out))

    def row(self, index: int) -> PromptRow:
        rng = random.Random(f"{self.seed}:{index}")
        while True:
            pair = self.task.draw(rng)
            if pair not in self.held_out:
                return self.task.row(*pair)

    def longest_prompts(self) -> list[PromptRow]:
        return [self.task.longest_row()]
