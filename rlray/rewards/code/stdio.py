"""The stdio format: the code runs as a program, once per case, with the case's input on
stdin; its output is compared here, never in its process.

Output is compared as the judges of APPS, CodeContests and Codeforces do: token by token,
white space normalised; tokens that are numbers compare as decimals (1.0 is 1), within
`float_tolerance` (absolute, or relative to the expected value) where it is given.
"""

from __future__ import annotations

import time
from dataclasses import replace
from decimal import Decimal, InvalidOperation

from rlray.rewards.code.referee import TestLimits, Verdict
from rlray.sandbox.run import run_python


def run_stdio(
    code: str, cases: list[tuple[str, str]], limits: TestLimits, float_tolerance: float | None
) -> list[Verdict]:
    """Returns the verdict of each (input, expected output) case: the code run as a program
    with the input on stdin, its output compared here (formats.same_output)."""
    end = time.monotonic() + limits.program_s
    verdicts = []
    for stdin, expected in cases:
        seconds = min(limits.test_s, end - time.monotonic())
        if seconds <= 0:
            verdicts.append(Verdict("timeout", f"the program's {limits.program_s:g} s ran out"))
            continue
        # Room for the expected output and more, so that a flood is cut, and fails.
        sandbox = replace(limits.sandbox(seconds), max_output_bytes=2 * len(expected) + 65536)
        result = run_python(code, sandbox, stdin=stdin.encode())
        if result.timed_out:
            verdicts.append(Verdict("timeout", f"past its {seconds:g} s"))
        elif result.returncode != 0:
            last = (result.stderr.strip().splitlines() or [""])[-1][:300]
            verdicts.append(Verdict("error", f"exit status {result.returncode}: {last}"))
        elif same_output(result.stdout, expected, float_tolerance):
            verdicts.append(Verdict("pass"))
        else:
            verdicts.append(Verdict("fail", "wrong output"))
    return verdicts


def same_output(got: str, expected: str, float_tolerance: float | None = None) -> bool:
    """Returns whether a program's output is the expected one, token by token (white
    space normalised); tokens that are numbers compare as decimals, within
    `float_tolerance` (absolute, or relative to the expected value) where it is given."""
    tokens, wanted = got.split(), expected.split()
    return len(tokens) == len(wanted) and all(
        a == b or _same_number(a, b, float_tolerance) for a, b in zip(tokens, wanted, strict=True)
    )


def _same_number(got: str, expected: str, tolerance: float | None) -> bool:
    try:
        a, b = Decimal(got), Decimal(expected)
    except InvalidOperation:
        return False
    if a == b or tolerance is None or not (a.is_finite() and b.is_finite()):
        return a == b
    return abs(a - b) <= Decimal(repr(tolerance)) * max(Decimal(1), abs(b))
