"""Runs a program's tests in two sandboxed processes that never meet: one holds the code,
the other the tests. This process relays the tests' requests to the code and the code's
answers back, checking both as plain data, and keeps each test's verdict.

Times: each test has `test_s` from its start (defining the code counts in the first test
that calls it), the program `program_s` for everything. A test past its time is a
timeout, and the process that ran over is killed: the code's is started again for the
next test that calls it, the tests' again from the next test.
"""

from __future__ import annotations

import builtins
import json
import math
import time
from dataclasses import dataclass
from typing import Any

from rlray.rewards.code.plain import NotPlain, decode, encode
from rlray.rewards.code.programs import code_program, test_program
from rlray.sandbox.run import SandboxLimits, SandboxSession

VERDICTS = ("pass", "fail", "error", "timeout")
MAX_MESSAGE_BYTES = 4 * 2**20  # a value that crosses: room for a list of some 10^5 items
_TIMED_OUT = "it ran out of time"  # a lost answer's reason that makes the test a timeout


@dataclass(frozen=True)
class Verdict:
    """How one test went: pass, fail (an assertion or a wrong output), error (an
    exception, a crash, a value that could not cross) or timeout; and why, briefly."""

    verdict: str
    detail: str = ""


@dataclass(frozen=True)
class ProgramTests:
    """One program's tests in the form both processes take."""

    code: str
    """What the code's process defines: the row's setup, then the completion's code."""
    setup: str
    """Code of the dataset's that the tests' process runs before the tests (HumanEval's
    prompt: imports, helpers the tests call, the function's signature)."""
    tests: list[str]
    """Python sources, one test each, run in turn in one namespace."""
    stand_ins: list[str]
    """The names the tests take from the code."""
    modules: list[str]
    """Standard modules the tests use without importing them."""


@dataclass(frozen=True)
class TestLimits:
    """Limits of one program's tests."""

    test_s: float = 5.0
    program_s: float = 30.0
    memory_mb: int = 512
    max_processes: int = 16

    def sandbox(self, seconds: float) -> SandboxLimits:
        """Returns the limits of one sandboxed process that may run `seconds`."""
        return SandboxLimits(
            timeout_s=seconds,
            cpu_s=max(1, math.ceil(seconds)),
            memory_mb=self.memory_mb,
            max_processes=self.max_processes,
            max_output_bytes=MAX_MESSAGE_BYTES,
        )


def run_tests(program: ProgramTests, limits: TestLimits) -> list[Verdict]:
    """Returns each test's verdict."""
    end = time.monotonic() + limits.program_s
    verdicts: list[Verdict | None] = [None] * len(program.tests)
    with _CodeProcess(program.code, limits, end) as code:
        first = 0
        while first < len(program.tests) and time.monotonic() < end:
            first = _run_from(first, program, code, verdicts, limits, end)
    budget = Verdict("timeout", f"the program's {limits.program_s:g} s ran out")
    return [_with_load_error(v or budget, code.load_error) for v in verdicts]


def _with_load_error(verdict: Verdict, load_error: str | None) -> Verdict:
    if load_error is None or verdict.verdict != "error":
        return verdict
    return Verdict("error", f"{verdict.detail} (defining the code raised {load_error})")


def _run_from(
    first: int,
    program: ProgramTests,
    code: _CodeProcess,
    verdicts: list[Verdict | None],
    limits: TestLimits,
    end: float,
) -> int:
    """Runs the tests from `first` in a tests' process of their own until it ends; returns
    the index of the first test it left unjudged."""
    source = test_program(program.setup, program.tests[first:], program.stand_ins, program.modules)
    with SandboxSession(source, limits.sandbox(end - time.monotonic())) as tests:
        current, lost = None, None
        deadline = min(time.monotonic() + limits.test_s, end)
        while True:
            line = tests.receive(deadline)
            message = _message(line)
            if message is None or message[0] == "done":
                break
            if message[0] == "begin":
                current, lost = first + message[1], None
                deadline = min(time.monotonic() + limits.test_s, end)
            elif message[0] == "ask":
                answer = code.ask(message[1], deadline)
                lost = lost or (answer[1] if answer[0] == "lost" else None)
                tests.send(json.dumps(answer).encode(), deadline)
            elif message[0] == "end":
                verdicts[current] = _lost_verdict(lost) or _verdict(message[2], message[3])
                current = None
    if message is not None:
        return len(program.tests)
    if time.monotonic() < deadline:
        stopped = Verdict("error", "the tests' process ended")
    elif deadline >= end:
        stopped = Verdict("timeout", f"the program's {limits.program_s:g} s ran out")
    else:
        stopped = Verdict("timeout", f"past its {limits.test_s:g} s")
    if current is None:  # before a test began: the setup failed, hung, or the budget ran out
        verdicts[first:] = [stopped] * (len(program.tests) - first)
        return len(program.tests)
    verdicts[current] = _lost_verdict(lost) or stopped
    return current + 1


def _message(line: bytes | None) -> list | None:
    """Returns a message of the tests' process, None for none (they are rlray's own)."""
    return None if line is None else json.loads(line)


def _verdict(verdict: Any, detail: Any) -> Verdict:
    if verdict not in VERDICTS or not isinstance(detail, str):
        return Verdict("error", "the tests' process reported nonsense")
    return Verdict(verdict, detail)


def _lost_verdict(lost: str | None) -> Verdict | None:
    """The verdict of a test in which the code's process gave no answer, whatever the
    test made of that (a bare `except:` would have passed it)."""
    if lost is None:
        return None
    timed_out = lost.startswith(_TIMED_OUT)
    return Verdict("timeout" if timed_out else "error", f"the code's process: {lost}")


class _Gone(Exception):
    """A handle to a value of a code's process that has since ended."""


class _CodeProcess:
    """The code's sandboxed process, started at once, and again on the first request
    after it ended; not again once it failed to define the code."""

    def __init__(self, code: str, limits: TestLimits, end: float):
        self.source, self.limits, self.end = code_program(code), limits, end
        self.session: SandboxSession | None = None
        self.ready = False
        self.load_error: str | None = None  # the exception defining the code raised
        self.failed: str | None = None  # why it could not start, for every later request
        self.generation = 0
        self.handles: list[tuple[int, int]] = []  # rlray's handle -> (generation, its own)
        self._start()

    def __enter__(self) -> _CodeProcess:
        return self

    def __exit__(self, *_: object) -> None:
        if self.session is not None:
            self.session.close()

    def _start(self) -> None:
        self.generation += 1
        self.ready = False
        self.session = SandboxSession(self.source, self.limits.sandbox(self.end - time.monotonic()))

    def ask(self, request: Any, deadline: float) -> list:
        """Returns the code's answer to `request` as the tests' process takes it."""
        if self.failed is not None:
            return ["lost", self.failed]
        if not self.session.open:
            self.session.close()
            self._start()
        if not self.ready and not self._await_ready(deadline):
            return ["lost", self.failed]
        try:
            line = json.dumps(self._to_code(request)).encode()
        except _Gone:
            return ["lost", "the value is gone with the process that held it"]
        if not self.session.send(line, deadline):
            return self._lost(deadline)
        answer = self.session.receive(deadline)
        try:
            return (
                self._from_code(json.loads(answer)) if answer is not None else self._lost(deadline)
            )
        except (ValueError, TypeError, NotPlain):  # the code wrote it
            self.session.close()
            return ["lost", "it answered nonsense"]

    def _await_ready(self, deadline: float) -> bool:
        line = self.session.receive(deadline)
        self.ready = line is not None and line.startswith(b'["ready"')
        if self.ready:
            self.load_error = _load_error(line)
        else:
            why = _TIMED_OUT if time.monotonic() >= deadline else "it ended"
            self.failed = f"{why} before the code was defined"
            self.session.close()
        return self.ready

    def _lost(self, deadline: float) -> list:
        self.session.close()
        return ["lost", _TIMED_OUT if time.monotonic() >= deadline else "it ended"]

    def _to_code(self, request: Any) -> list:
        """Returns the tests' request with rlray's handles put as the code's own."""
        kind, target, *rest = request
        if kind == "call":
            rest = [self._refs_to_code(rest[0]), self._refs_to_code(rest[1])]
        elif kind == "item":
            rest = [self._refs_to_code(rest[0])]
        elif kind == "attr":
            rest = [str(rest[0])]
        elif kind not in ("value", "list"):
            raise ValueError(f"no such request: {kind}")
        return [kind, self._target(target), *rest]

    def _target(self, target: Any) -> list:
        where, key = target
        if where == "name":
            return ["name", str(key)]
        generation, own = self.handles[key]
        if generation != self.generation:
            raise _Gone()
        return ["handle", own]

    def _refs_to_code(self, tagged: Any) -> list:
        return encode(decode(tagged, _Ref), lambda ref: self._target(ref.target))

    def _from_code(self, answer: Any) -> list:
        """Returns the code's answer checked as plain data, its handles rlray's."""
        kind = answer[0]
        if kind == "value":
            return ["value", encode(decode(answer[1]))]
        if kind == "handle" and type(answer[1]) is int:
            self.handles.append((self.generation, answer[1]))
            return ["handle", len(self.handles) - 1]
        if kind == "raised":
            error = getattr(builtins, answer[1], None)
            if isinstance(error, type) and issubclass(error, BaseException):
                return ["raised", answer[1], str(answer[2])[:500]]
        raise ValueError(f"no such answer: {kind}")


def _load_error(ready: bytes) -> str | None:
    """Returns the builtin exception that defining the code raised, from its first line."""
    try:
        error = json.loads(ready)[1]
    except (ValueError, IndexError):
        return None
    return (
        error
        if isinstance(error, str) and isinstance(getattr(builtins, error, None), type)
        else None
    )


@dataclass(frozen=True)
class _Ref:
    target: Any
