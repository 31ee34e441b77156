"""The `code_tests` reward: the fraction of an episode's tests that its completion's code passes.

Threat model: completions are untrusted, and a policy under RL finds any way to a higher
score; the tests come from the dataset and are trusted. The code runs in an
rlray.sandbox child (own namespaces and file system, seccomp, limits, no network, not
root: see rlray/sandbox/run.py for what holds where), and owns that process: it can
read its frames and every object in it, write to any of its file descriptors, and exit
whenever it likes. So that process decides nothing:

- The parent splits each test. Every expression whose value the code chooses becomes a
  probe: a name the tests take from the code, and the calls, attributes and items
  chained on it (`add(1, 2)`, `Solution().two_sum([2, 7], 9)`, `grid.cells[0]`). The
  rest (the comparison, the expected value, `math.isclose`, `sorted`) stays out.
- The code's process gets the code and the probes, never the tests. It reports each
  probe's value as plain data: exact builtin types (None, bool, int, float, complex,
  str, bytes, and list, tuple, set, frozenset, dict of those), read without calling a
  method of the code's; anything else (an int subclass with its own `__eq__`) does not
  cross. A probe that raised reports the builtin class its exception derives from.
- The verdict is reached where none of the code runs: here for an assert of probes and
  literals, compared and joined by `and`, `or`, `not` (`assert f(1) == 2`), by
  Python's operators on plain values; for any other test in a second sandbox run that
  holds the tests and the reported values, and not the code.

Why that holds: the expected values never enter the code's process, so no inspection
of it finds them; and the code could have returned each probe's value honestly (it
defines what `add` returns), so whatever it forges (through frames, gc, its output, an
early os._exit) scores what a program returning those values would. Forging is thus no
stronger than special-casing the tests' inputs, which no reward made of tests can tell
from solving.

Limits: only plain data crosses, so a test that needs one of the code's objects fails
(`isinstance(f(), Point)`, or passing `f` itself as HumanEval's `check(candidate)`
does). A test whose call into the code uses the test's own variables (`for x in
range(3): assert f(x) == x`) cannot be split: it fails, and the log says so once.
Probes run once each, in order, not where the test's control flow would reach them.
Where the sandbox has no namespaces, a process that escapes the code's run can reach the
verdict run (both are the same user's).
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import json
import logging
import math
import operator
import pickle
import re
import sys
import textwrap
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlray.data.chat import accepts_chat
from rlray.sandbox.run import SandboxLimits, run_python

logger = logging.getLogger(__name__)

# A fenced block, any language (so that a ```bash block's closing fence is not taken for
# an opening one): (language, body). An unclosed block, as in a completion cut at its
# token limit, runs to the end of the text.
_FENCED_BLOCK = re.compile(
    r"^[ \t]*```[ \t]*([\w+.-]*).*?\n(.*?)(?:^[ \t]*```[ \t]*$|\Z)", re.M | re.S
)
_PYTHON_TAGS = {"", "python", "python3", "py"}

_PROBE = "__probe__"  # what a test calls, in the verdict run, for a probe's value
_MAX_DEPTH = 100  # nesting of a reported value
_MAX_REPORT_BYTES = 4 * 2**20  # the code's reports: room for a list of some 10^5 items
_BUILTIN_NAMES = frozenset(dir(builtins))

# Runs in the code's sandbox; `_report(code, probes, modules)` is appended. Its reports
# are claims the code could forge at will (see the module docstring): nothing here is a
# defence, only a faithful report for code that does not forge.
_PROBE_HARNESS = """\
import json
import os

_ATOMS = (
    (type(None), lambda value: None),
    (bool, lambda value: value),
    (int, hex),
    (float, float.hex),
    (complex, lambda value: [value.real.hex(), value.imag.hex()]),
    (str, lambda value: value),
    (bytes, bytes.hex),
)


def _plain(value, depth=0):
    # Exact types, compared by identity: a subclass's methods, or its metaclass's
    # __eq__, would be the code's.
    kind = type(value)
    if depth > 100:
        raise ValueError("nested too deep")
    for atom, encode in _ATOMS:
        if kind is atom:
            return [atom.__name__, encode(value)]
    for container in (list, tuple, set, frozenset):
        if kind is container:
            return [container.__name__, [_plain(item, depth + 1) for item in value]]
    if kind is dict:
        pairs = [[_plain(k, depth + 1), _plain(v, depth + 1)] for k, v in value.items()]
        return ["dict", pairs]
    raise TypeError(f"{kind.__name__} is not plain data")


def _outcome(probe, index, namespace):
    try:
        value = eval(compile(probe, f"<probe {index}>", "eval"), namespace)
    except BaseException as error:
        base = next(c for c in type(error).__mro__ if c.__module__ == "builtins")
        return ["raised", base.__name__]
    try:
        return ["value", _plain(value)]
    except BaseException:
        return ["opaque", None]


def _report(code, probes, modules):
    results = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the code's prints go nowhere
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(code, "<solution>", "exec"), namespace)
    except BaseException:
        pass  # the probes still run against what it defined
    for name in modules:  # as the tests' own imports would (`f(math.pi)`)
        try:
            namespace.setdefault(name, __import__(name))
        except BaseException:
            pass
    for index, probe in enumerate(probes):
        outcome = json.dumps(_outcome(probe, index, namespace))
        os.write(results, f"{index} {outcome}\\n".encode())
"""

# Runs in a sandbox without the code; `_judge(tests, modules, outcomes)` is appended.
# `outcomes` holds, per probe, ("value", plain value), ("raised", builtin exception's
# name) or None (no value reported).
_VERDICT_HARNESS = """\
import builtins
import os
import pickle


class NoValue(Exception):
    \"\"\"The code reported no plain value for this expression.\"\"\"


def _judge(tests, modules, outcomes):
    results = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the tests' prints go nowhere

    def probe(index):
        kind, payload = outcomes[index] or ("none", None)
        if kind == "value":
            return payload
        raise getattr(builtins, payload) if kind == "raised" else NoValue()

    namespace = {"__name__": "__main__", "__probe__": probe}
    for name in modules:  # standard modules the tests use without importing them
        try:
            namespace[name] = __import__(name)
        except BaseException:
            pass
    for index, test in enumerate(tests):
        try:
            exec(compile(test, f"<test {index}>", "exec"), namespace)
            outcome = "pass"
        except BaseException:
            outcome = "fail"
        os.write(results, f"{index} {outcome}\\n".encode())
"""
# Where a test cannot be split, the verdict run runs this instead.
_CANNOT_SPLIT = "raise AssertionError('cannot be judged apart from the code')"


@dataclasses.dataclass
class _SplitTests:
    """An episode's tests with every expression whose value the code chooses taken out."""

    trees: list[ast.Module | None]
    """Each test, its probes replaced by `__probe__(index)`; None where it cannot be
    split (or parsed): it fails."""
    probes: list[str]
    """The expressions the code's process evaluates, by index."""
    modules: list[str]
    """Standard modules the tests use (`math.pi`), imported for them in both runs."""


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
    or one string with a test per non-empty line. `timeout_s` bounds each of an episode's
    sandbox runs: its code's, and where needed the verdict's."""
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
    split = _split(tests)
    outcomes = _probe_outcomes(extract_code(completion), split, limits)
    verdicts = [_verdict_here(tree, outcomes) for tree in split.trees]
    if None in verdicts:
        verdicts = _verdicts_in_sandbox(split, outcomes, limits)
    return sum(verdicts) / len(tests)


# Splitting the tests (in the parent: no code of the completion is involved).


def _split(tests: list[str]) -> _SplitTests:
    trees = [_parse(test) for test in tests]
    parsed = [tree for tree in trees if tree is not None]
    # The tests share one namespace, so a name one of them binds is the tests' in all;
    # but for standard modules, which both runs import where the tests use them.
    bound = set().union(*map(_bound_names, parsed)) - set().union(*map(_modules_imported, parsed))
    splitter = _ProbeSplitter(bound)
    for index, tree in enumerate(trees):
        if tree is None:
            continue
        first = len(splitter.probes)
        trees[index] = splitter.split(tree)
        if any(_free_names(probe) & bound for probe in splitter.probes[first:]):
            _warn_cannot_split(tests[index])
            trees[index] = None
            del splitter.probes[first:]
    return _SplitTests(
        trees, [ast.unparse(probe) for probe in splitter.probes], sorted(splitter.modules)
    )


def _modules_imported(tree: ast.Module) -> set[str]:
    """Returns the standard modules `tree` imports under their own names (`import math`)."""
    return {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.asname in (None, alias.name) and alias.name in sys.stdlib_module_names
    }


def _parse(test: str) -> ast.Module | None:
    try:
        return ast.parse(test)
    except (SyntaxError, ValueError):
        return None  # fails, as it would have run


class _ProbeSplitter(ast.NodeTransformer):
    """Replaces each expression whose value the code chooses by a `__probe__(index)` call,
    and collects those expressions (`probes`) and the standard modules used (`modules`)."""

    def __init__(self, bound: set[str]):
        self.bound = bound
        self.probes: list[ast.expr] = []
        self.modules: set[str] = set()
        self._module_roots: set[int] = set()

    def split(self, tree: ast.Module) -> ast.Module:
        for node in ast.walk(tree):  # `math` in `math.pi`: the module, if not bound
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                name = node.value.id
                if name in sys.stdlib_module_names and name not in self.bound:
                    self._module_roots.add(id(node.value))
                    self.modules.add(name)
        return ast.fix_missing_locations(self.visit(tree))

    def _probe_or_visit(self, node: ast.expr) -> ast.expr:
        root = _chain_root(node)
        if isinstance(getattr(node, "ctx", None), (ast.Store, ast.Del)) or not (
            root is not None and self._is_the_codes(root)
        ):
            return self.generic_visit(node)
        self.probes.append(node)
        placeholder = ast.Name(_PROBE, ast.Load())
        return ast.Call(placeholder, [ast.Constant(len(self.probes) - 1)], [])

    visit_Name = visit_Attribute = visit_Subscript = visit_Call = _probe_or_visit

    def _is_the_codes(self, name: ast.Name) -> bool:
        return not (
            name.id in self.bound
            or name.id in _BUILTIN_NAMES
            or name.id == _PROBE
            or id(name) in self._module_roots
        )


def _chain_root(node: ast.expr) -> ast.Name | None:
    """Returns the name a chain of calls, attributes and items starts from (`f` in
    `f(1).x[0]`), None where it starts from anything else."""
    while isinstance(node, (ast.Call, ast.Attribute, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node if isinstance(node, ast.Name) else None


def _bound_names(tree: ast.AST) -> set[str]:
    """Returns the names `tree` binds anywhere: assigned, imported, defined, parameters,
    loop and comprehension variables."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).partition(".")[0])
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            names.update(node.names)
    return names


def _free_names(node: ast.AST) -> set[str]:
    loaded = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    return loaded - _bound_names(node)


@functools.lru_cache(maxsize=1024)  # once per test, not once per sample of its prompt
def _warn_cannot_split(test: str) -> None:
    logger.warning(
        "code_tests: this test calls into the code with its own variables, so it cannot "
        "be judged apart from the code, and fails: %r",
        test,
    )


# The code's run: its reports read as claims.


def _probe_outcomes(
    code: str, split: _SplitTests, limits: SandboxLimits
) -> list[tuple[str, Any] | None]:
    """Returns per probe what the code's run reported: ("value", plain value) or
    ("raised", builtin exception's name); None where it reported no readable outcome
    exactly once (it died, timed out, forged a second report, or the value was not
    plain)."""
    probes, modules = split.probes, split.modules
    if not probes:
        return []  # no test depends on the code
    source = f"{_PROBE_HARNESS}\n_report({code!r}, {probes!r}, {modules!r})\n"
    result = run_python(source, dataclasses.replace(limits, max_output_bytes=_MAX_REPORT_BYTES))
    reports: defaultdict[int, list[str]] = defaultdict(list)
    for line in result.stdout.splitlines():
        index, _, report = line.partition(" ")
        if index.isascii() and index.isdigit():
            reports[int(index)].append(report)
    return [_outcome(reports[i][0]) if len(reports[i]) == 1 else None for i in range(len(probes))]


def _outcome(report: str) -> tuple[str, Any] | None:
    try:
        kind, payload = json.loads(report)
        if kind == "value":
            return kind, _decode(payload)
        error = getattr(builtins, payload, None) if kind == "raised" else None
        if isinstance(error, type) and issubclass(error, BaseException):
            return kind, payload
    except Exception:  # anything malformed is no report: the code wrote it
        pass
    return None


def _exact(kind: type):
    def check(payload: Any) -> Any:
        if type(payload) is not kind:
            raise TypeError(f"expected {kind.__name__}, got {type(payload).__name__}")
        return payload

    return check


_ATOMS = {
    "NoneType": _exact(type(None)),
    "bool": _exact(bool),
    "int": lambda payload: int(_exact(str)(payload), 16),
    "float": float.fromhex,
    "complex": lambda payload: complex(*map(float.fromhex, _exact(list)(payload))),
    "str": _exact(str),
    "bytes": bytes.fromhex,
}
_CONTAINERS = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}


def _decode(tagged: Any, depth: int = 0) -> Any:
    """Returns the builtin value that a reported [type name, payload] stands for; raises
    on anything else."""
    tag, payload = tagged
    if depth > _MAX_DEPTH:
        raise ValueError("nested too deep")
    if tag in _CONTAINERS:
        return _CONTAINERS[tag](_decode(item, depth + 1) for item in _exact(list)(payload))
    if tag == "dict":
        pairs = _exact(list)(payload)
        return {_decode(key, depth + 1): _decode(value, depth + 1) for key, value in pairs}
    return _ATOMS[tag](payload)


# Verdicts, reached without the code.


class _NotHere(Exception):
    """The test has a form that is judged in the verdict run."""


_COMPARISONS = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.In: lambda item, container: item in container,
    ast.NotIn: lambda item, container: item not in container,
}


def _verdict_here(tree: ast.Module | None, outcomes: list) -> bool | None:
    """Returns whether a test that is one assert of probes and literals, compared and
    joined by `and`, `or` and `not` (`assert f(1) == 2`, `assert not f(0)`), passes on
    the plain values here; None for a test of another form."""
    if tree is None:
        return False
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return None
    try:
        return bool(_value_here(tree.body[0].test, outcomes))
    except _NotHere:
        return None
    except Exception:  # where the assert would have raised: a probe without value, "a" < 1
        return False


def _value_here(node: ast.expr, outcomes: list) -> Any:
    """Returns the value of `node` on the plain values here (Python's operators on builtin
    types run no code of the completion's); raises _NotHere for a form it does not take."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == _PROBE:
        outcome = outcomes[node.args[0].value]
        if outcome is None or outcome[0] != "value":
            raise LookupError("the code reported no value")
        return outcome[1]
    if isinstance(node, ast.Compare):
        left = _value_here(node.left, outcomes)
        for op, comparator in zip(node.ops, node.comparators, strict=True):
            right = _value_here(comparator, outcomes)
            if not _COMPARISONS[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.BoolOp):  # short-circuits as Python does
        for operand in node.values:
            value = _value_here(operand, outcomes)
            if bool(value) != isinstance(node.op, ast.And):
                return value
        return value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return not _value_here(node.operand, outcomes)
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as error:
        raise _NotHere from error


def _verdicts_in_sandbox(split: _SplitTests, outcomes: list, limits: SandboxLimits) -> list[bool]:
    """Returns per test whether it passed, run with the reported values but not the code."""
    tests = [_CANNOT_SPLIT if tree is None else ast.unparse(tree) for tree in split.trees]
    judge = f"_judge({tests!r}, {split.modules!r}, pickle.loads({pickle.dumps(outcomes)!r}))"
    result = run_python(f"{_VERDICT_HARNESS}\n{judge}\n", limits)
    return _passed(result.stdout, len(tests))


def _passed(stdout: str, count: int) -> list[bool]:
    """Returns per test whether exactly one line reports it, as passed (a test left
    without a report, as when the run timed out, failed)."""
    reports: defaultdict[str, list[str]] = defaultdict(list)
    for line in stdout.splitlines():
        index, _, outcome = line.partition(" ")
        reports[index].append(outcome)
    return [reports[str(i)] == ["pass"] for i in range(count)]
