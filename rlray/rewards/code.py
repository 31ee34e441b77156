"""The `code_tests` reward: the fraction of an episode's tests that its completion's code passes.

Security model: completions are untrusted. An episode's code and tests run in one
rlray.sandbox child (own namespaces and temporary files, read-only file system, seccomp;
time, CPU, memory, process limits; no network; not root: see that module for fallbacks).
There the code's prints go to /dev/null and each test's result to a saved stdout, tagged with
a random marker; a test counts if exactly one tagged line says it passed. This stops printed
forgeries, not code that digs the marker out of the harness's frames (same process).
"""

from __future__ import annotations

import math
import re
import secrets
import textwrap
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlray.data.chat import accepts_chat
from rlray.sandbox.run import SandboxLimits, run_python

# A fenced block, any language (so that a ```bash block's closing fence is not taken for
# an opening one): (language, body). An unclosed block, as in a completion cut at its
# token limit, runs to the end of the text.
_FENCED_BLOCK = re.compile(
    r"^[ \t]*```[ \t]*([\w+.-]*).*?\n(.*?)(?:^[ \t]*```[ \t]*$|\Z)", re.M | re.S
)
_PYTHON_TAGS = {"", "python", "python3", "py"}

# Runs in the sandbox; `_run(code, tests, marker)` is appended. What the harness calls is
# bound as default arguments before the code runs, so that the code cannot replace it
# (e.g. `builtins.exec = print` would otherwise pass every test).
_HARNESS = """\
import os
import sys


def _run(code, tests, marker, exec=exec, compile=compile, range=range, len=len,
         write=os.write, results=os.dup(1)):
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the code's prints go nowhere
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(code, "<solution>", "exec"), namespace)
    except BaseException as error:  # tests still run against what it defined
        print(f"solution raised {type(error).__name__}: {error}", file=sys.stderr)
    for index in range(len(tests)):
        try:
            exec(compile(tests[index], f"<test {index}>", "exec"), namespace)
            outcome = "pass"
        except BaseException:
            outcome = "fail"
        write(results, f"{marker} {index} {outcome}\\n".encode())
"""


@accepts_chat
def code_tests(
    prompts: list[str],
    completions: list[str],
    tests: list[list[str] | str | None] | None = None,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_processes: int = 16,
    **_: Any,
) -> list[float | None]:
    """Returns, per completion, the fraction of its episode's tests that its code passes;
    None where the episode has no tests.

    `tests` holds per episode a list of tests (each Python source, typically an assert)
    or one string with a test per non-empty line. `timeout_s` bounds one episode's run."""
    if tests is None:
        tests = [None] * len(completions)
    if len(tests) != len(completions):
        raise ValueError(f"{len(tests)} tests for {len(completions)} completions")
    limits = SandboxLimits(
        timeout_s=timeout_s,
        cpu_s=max(1, math.ceil(timeout_s)),
        memory_mb=memory_mb,
        max_processes=max_processes,
    )
    with ThreadPoolExecutor(max_workers=2) as pool:  # two cores on the reference machine
        return list(pool.map(lambda c, t: _score(c, _test_list(t), limits), completions, tests))


def extract_code(completion: str) -> str:
    """Returns the last fenced Python (or untagged) block of `completion`, else all of it."""
    blocks = [
        body for tag, body in _FENCED_BLOCK.findall(completion) if tag.lower() in _PYTHON_TAGS
    ]
    return textwrap.dedent(blocks[-1]) if blocks else completion  # fences may be indented


def _test_list(value: list[str] | str | None) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [line.strip() for line in value.splitlines() if line.strip()]
    return [str(test) for test in value if str(test).strip()]


def _score(completion: str, tests: list[str], limits: SandboxLimits) -> float | None:
    if not tests:
        return None
    marker = secrets.token_hex(16)
    harness = f"{_HARNESS}\n_run({extract_code(completion)!r}, {tests!r}, {marker!r})\n"
    result = run_python(harness, limits)
    # Tests without a report (the run died or timed out first) count as failed.
    return _passed(result.stdout, marker, len(tests)) / len(tests)


def _passed(stdout: str, marker: str, count: int) -> int:
    """Returns how many tests exactly one marked line reports, as passed."""
    reports: Counter[str] = Counter()
    passes = set()
    for line in stdout.splitlines():
        tag, _, rest = line.partition(" ")
        if tag == marker:
            index, _, outcome = rest.partition(" ")
            reports[index] += 1
            if outcome == "pass":
                passes.add(index)
    return sum(reports[str(i)] == 1 and str(i) in passes for i in range(count))
