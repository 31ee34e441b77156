"""The `code_tests` reward: the share of an episode's tests that its completion's code
passes, each test's verdict kept on the episode."""

from __future__ import annotations

import functools
import logging
import re
import textwrap
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlray.core.episode import Score
from rlray.data.chat import accepts_chat
from rlray.rewards.code.formats import FORMATS, io_pairs, program_tests
from rlray.rewards.code.referee import TestLimits, Verdict, run_tests
from rlray.rewards.code.stdio import run_stdio

logger = logging.getLogger(__name__)

# A fenced block, any language (so that a ```bash block's closing fence is not taken for
# an opening one): (language, body). An unclosed block, as in a completion cut at its
# token limit, runs to the end of the text.
_FENCED_BLOCK = re.compile(
    r"^[ \t]*```[ \t]*([\w+.-]*).*?\n(.*?)(?:^[ \t]*```[ \t]*$|\Z)", re.M | re.S
)
_PYTHON_TAGS = {"", "python", "python3", "py"}


@accepts_chat
def code_tests(
    prompts: list[str],
    completions: list[str],
    tests: list[Any] | None = None,
    test_format: list[str | None] | None = None,
    entry_point: list[str | None] | None = None,
    setup: list[str | None] | None = None,
    *,
    format: str = "assert",
    timeout_s: float = 5.0,
    budget_s: float = 30.0,
    memory_mb: int = 512,
    max_processes: int = 16,
    all_or_nothing: bool = False,
    float_tolerance: float | None = None,
    **_: Any,
) -> list[Score | None]:
    """Returns, per completion, the share of its episode's tests that its code passes (1 or
    0 with `all_or_nothing`), with each test's verdict as its detail; None where the
    episode has no tests.

    Columns: `tests`, in the row's `test_format` (else `format`: assert, check,
    functional or stdio; rlray.rewards.code.formats), `entry_point` (check, functional)
    and `setup` (code the program starts with: HumanEval's prompt). Each test has
    `timeout_s`, each program `budget_s`; each process `memory_mb` and `max_processes`."""
    count = len(completions)
    columns = [column or [None] * count for column in (tests, test_format, entry_point, setup)]
    if any(len(column) != count for column in columns):
        raise ValueError(f"columns of {[len(c) for c in columns]} rows for {count} completions")
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {format!r}")
    limits = TestLimits(timeout_s, budget_s, memory_mb, max_processes)

    def score(completion: str, row_tests: Any, row_format: Any, entry: Any, code_setup: Any):
        verdicts = _verdicts(
            extract_code(completion),
            row_tests,
            row_format or format,
            entry,
            code_setup or "",
            limits,
            float_tolerance,
        )
        return _score(verdicts, all_or_nothing)

    # Two programs at once, each a sandboxed process of its own: more would compete with
    # the run's other processes for the cores.
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(score, completions, *columns))


def extract_code(completion: str) -> str:
    """Returns the last fenced Python (or untagged) block of `completion`, else all of it."""
    blocks = [
        body for tag, body in _FENCED_BLOCK.findall(completion) if tag.lower() in _PYTHON_TAGS
    ]
    return textwrap.dedent(blocks[-1]) if blocks else completion  # fences may be indented


def _verdicts(
    code: str,
    tests: Any,
    test_format: str,
    entry_point: str | None,
    setup: str,
    limits: TestLimits,
    float_tolerance: float | None,
) -> list[Verdict]:
    if test_format == "stdio":
        return run_stdio(f"{setup}\n{code}", io_pairs(tests), limits, float_tolerance)
    program = program_tests(test_format, code, tests, setup, entry_point)
    verdicts = run_tests(program, limits) if program.tests else []
    for test, verdict in zip(program.tests, verdicts, strict=True):
        if "not plain data" in verdict.detail:
            _warn_not_plain(test)
    return verdicts


def _score(verdicts: list[Verdict], all_or_nothing: bool) -> Score | None:
    if not verdicts:
        return None
    passed = sum(v.verdict == "pass" for v in verdicts)
    value = float(passed == len(verdicts)) if all_or_nothing else passed / len(verdicts)
    return Score(value, {"tests": [[v.verdict, v.detail] for v in verdicts]})


@functools.lru_cache(maxsize=1024)  # once per test, not once per sample of its prompt
def _warn_not_plain(test: str) -> None:
    logger.warning(
        "code_tests: a value crossing between the code and this test is not plain data "
        "(one of the code's objects, or a function of the test's), so the test fails; "
        "each episode's verdicts say where (further ones are not logged): %r",
        test[:500],
    )
