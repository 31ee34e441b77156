"""The test formats of code datasets, each turned into what rlray runs.

- `assert` (MBPP, and rlray's own): `tests` is a list of tests, or one string with a test
  per non-empty line; each is Python (an assert, a loop of asserts, a function and its
  call), run in turn in one namespace after the row's `setup`.
- `check` (HumanEval): `tests` is the test code that defines `check(candidate)`; the one
  test is `check(<entry_point>)`, run after `setup` (HumanEval's prompt: its imports and
  helpers are the tests' as well as the code's).
- `functional` (LiveCodeBench's LeetCode problems): `tests` is a list of {"input": one JSON
  value per line, the arguments, "output": JSON}; each calls `entry_point` (a method of
  `Solution()` where the code defines that class, as LiveCodeBench does) and compares
  the return value, a tuple read as a list, with the output.
- `stdio` (APPS, CodeContests, TACO, Codeforces, LiveCodeBench's stdin problems): `tests`
  is a list of {"input": text, "output": text}, or {"inputs": [...], "outputs": [...]};
  the code runs as a program with the input on stdin, and its output is compared outside
  its process (stdio.py).
"""

from __future__ import annotations

import ast
import builtins
import json
import symtable
import sys
from typing import Any

from rlray.rewards.code.referee import ProgramTests

FORMATS = ("assert", "check", "functional", "stdio")
_BUILTINS = frozenset(dir(builtins))


def program_tests(
    test_format: str, code: str, tests: Any, setup: str, entry_point: str | None
) -> ProgramTests:
    """Returns the row's tests (of a format other than stdio) as the two processes run them."""
    if test_format == "assert":
        sources = test_list(tests)
    elif test_format == "check":
        sources = [f"{_one_text(tests)}\n\ncheck({_entry(entry_point)})\n"]
    elif test_format == "functional":
        sources = [_functional_test(code, case, _entry(entry_point)) for case in io_pairs(tests)]
    else:
        raise ValueError(f"unknown test format {test_format!r}; one of {', '.join(FORMATS)}")
    stand_ins, modules = _names_from_code([setup, *sources], _defined(f"{setup}\n{code}"))
    if test_format == "check":
        stand_ins.add(_entry(entry_point))  # the setup's stub of it is not the code
    return ProgramTests(f"{setup}\n{code}", setup, sources, sorted(stand_ins), sorted(modules))


def test_list(tests: Any) -> list[str]:
    """Returns the tests of the `assert` format: a list's items, or a string's lines."""
    if tests is None:
        return []
    if isinstance(tests, str):
        return [line.strip() for line in tests.splitlines() if line.strip()]
    return [str(test) for test in tests if str(test).strip()]


def io_pairs(tests: Any) -> list[tuple[str, str]]:
    """Returns (input, output) pairs from [{"input", "output"}, ...] or {"inputs",
    "outputs"} (either possibly as JSON text); outputs that are not text as JSON text."""
    if isinstance(tests, str):
        tests = json.loads(tests)
    if isinstance(tests, dict):
        tests = [
            {"input": i, "output": o}
            for i, o in zip(tests["inputs"], tests["outputs"], strict=True)
        ]
    return [(_as_text(case["input"]), _as_text(case["output"])) for case in tests or []]


def _as_text(value: Any) -> str:
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    return value if isinstance(value, str) else json.dumps(value)


def _one_text(tests: Any) -> str:
    if isinstance(tests, list) and len(tests) == 1:
        tests = tests[0]
    if not isinstance(tests, str):
        raise ValueError("tests of the check format are one text that defines check()")
    return tests


def _entry(entry_point: str | None) -> str:
    if not entry_point or not str(entry_point).isidentifier():
        raise ValueError(f"entry_point must name the function under test, not {entry_point!r}")
    return str(entry_point)


def _functional_test(code: str, case: tuple[str, str], entry_point: str) -> str:
    arguments, expected = case
    # LiveCodeBench's rule: a LeetCode solution is a method of class Solution.
    callee = f"Solution().{entry_point}" if "class Solution" in code else entry_point
    return (
        f"__got = {callee}(*[json.loads(line) for line in {arguments!r}.split('\\n')])\n"
        "if type(__got) is tuple:\n"
        "    __got = list(__got)\n"
        f"assert __got == json.loads({expected!r})\n"
    )


def _names_from_code(sources: list[str], defined: set[str]) -> tuple[set[str], set[str]]:
    """Returns (names the sources read but do not define, which the tests take from the
    code; standard modules among those, which the tests' process imports instead, unless
    the code defines that name as something else: `defined`)."""
    bound: set[str] = set()
    read: set[str] = set()
    for source in sources:
        try:
            top = symtable.symtable(source, "<test>", "exec")
        except (SyntaxError, ValueError):
            continue  # it fails as it runs
        bound |= {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
        read |= _globals_read(top)
    free = read - bound - _BUILTINS
    modules = {name for name in free if name in sys.stdlib_module_names and name not in defined}
    return free - modules, modules


def _defined(code: str) -> set[str]:
    """Returns the names the code binds at its top level other than by importing the
    standard module of that name (`import math` leaves math the tests' own)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return set()
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.asname and a.asname != a.name}
        else:
            names |= _bound_at_top(node)
    return names


def _bound_at_top(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.ImportFrom):
        return {(a.asname or a.name) for a in node.names}
    return {
        n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }


def _globals_read(table: symtable.SymbolTable) -> set[str]:
    names = {s.get_name() for s in table.get_symbols() if s.is_referenced() and s.is_global()}
    for child in table.get_children():
        names |= _globals_read(child)
    return names
