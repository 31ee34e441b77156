"""What runs in the tests' sandbox: the tests, with each name they take from the code a
stand-in (`Remote`) whose calls go to the code's process as plain data.

The process talks to rlray (rlray.rewards.code.referee) in lines on its stdin and stdout:

    ["begin", i]                  test i starts
    ["ask", request]              a request for the code's process (code_side.py)
    ["end", i, verdict, detail]   test i ended: pass, fail (an assertion), error (anything
                                  else: an exception, a value that could not cross)
    ["done"]

and to each "ask" gets an answer back: the code's (["value", ...], ["handle", n],
["raised", ...]) or ["lost", why] where the code's process gave none.

Nothing of the code runs here: a stand-in's operators work on the plain value it stands
for, and one that stands for something else (one of the code's objects) refuses them.

This module imports only the standard library and rlray.rewards.code.plain (see
code_side.py).
"""

from __future__ import annotations

import builtins
import contextlib
import json
import operator
import os

from rlray.rewards.code.plain import NotPlain, decode, encode

_channel: dict = {}


# Not an Exception: a test's `except Exception` does not swallow it.
class CodeLost(BaseException):
    """The code's process gave no answer: it ended, ran out of time, or wrote nonsense."""


class NotPlainData(TypeError):
    """A value that cannot cross between the two processes: a TypeError, as for any
    operation a type does not support (list() asks a length hint first, and goes on)."""


class Remote:
    """One of the code's values: a name the tests take from it, or what it answered that
    is not plain data. Calls, attributes, items and iteration are asked of the code's
    process; any other operator works on the plain value, where it is one."""

    __slots__ = ("_target",)

    def __init__(self, target: list):
        object.__setattr__(self, "_target", target)

    def __call__(self, *args, **kwargs):
        return _ask(["call", self._target, _encode(list(args)), _encode(kwargs)])

    def __getattr__(self, name: str):
        if name.startswith("__"):  # protocols probed by copy, pickle, inspect: not asked
            raise AttributeError(name)
        return _ask(["attr", self._target, name])

    def __getitem__(self, key):
        return _ask(["item", self._target, _encode(key)])

    def __iter__(self):
        return iter(_ask(["list", self._target]))

    def __setattr__(self, name: str, value) -> None:
        raise NotPlainData(f"cannot set {name} on a value of the code's")

    def __repr__(self) -> str:
        return f"<{self._target[1]} of the code's>"

    def __str__(self) -> str:
        try:
            return str(self._plain())
        except NotPlainData:
            return repr(self)

    def _plain(self):
        value = _ask(["value", self._target])
        if isinstance(value, Remote):
            raise NotPlainData(f"{self!r} is not plain data")
        return value


def _unary(function):
    return lambda self: function(self._plain())


def _binary(function):
    return lambda self, other: function(self._plain(), other)


def _reflected(function):
    return lambda self, other: function(other, self._plain())


for _name, _function in {
    "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
    "gt": operator.gt, "ge": operator.ge, "contains": operator.contains,
}.items():  # fmt: skip
    setattr(Remote, f"__{_name}__", _binary(_function))
for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor"):
    _function = (
        getattr(operator, f"{_name}_") if _name in ("and", "or") else getattr(operator, _name)
    )
    setattr(Remote, f"__{_name}__", _binary(_function))
    setattr(Remote, f"__r{_name}__", _reflected(_function))
for _name, _function in {
    "hash": hash, "bool": bool, "len": len, "int": int, "float": float, "index": operator.index,
    "neg": operator.neg, "pos": operator.pos, "abs": abs, "invert": operator.invert,
}.items():  # fmt: skip
    setattr(Remote, f"__{_name}__", _unary(_function))
Remote.__round__ = lambda self, *digits: round(self._plain(), *digits)


def _encode(value) -> list:
    def reference(item):
        if isinstance(item, Remote):
            return item._target
        raise NotPlainData(f"{type(item).__name__} of the tests' is not plain data")

    return encode(value, reference)


def _ask(request: list):
    _send(["ask", request])
    answer = json.loads(_channel["in"].readline())
    kind = answer[0]
    if kind == "value":
        return decode(answer[1], Remote)
    if kind == "handle":
        return Remote(["handle", answer[1]])
    if kind == "raised":
        raise _exception(answer[1], answer[2])
    raise CodeLost(answer[1])


def _exception(name: str, message: str) -> BaseException:
    """Returns the builtin exception `name` (checked by rlray) with `message`, or the
    nearest class it derives from that takes a message alone (UnicodeDecodeError does
    not)."""
    for kind in getattr(builtins, name).__mro__:
        try:
            return kind(message)
        except TypeError:
            continue
    return Exception(message)


def _send(message: list) -> None:
    data = memoryview(json.dumps(message).encode() + b"\n")
    while data:
        data = data[os.write(_channel["out"], data) :]


def main(setup: str, tests: list[str], stand_ins: list[str], modules: list[str]) -> None:
    """Runs `setup`, then each test in turn, in one namespace in which each of
    `stand_ins` is a Remote and each of `modules` (standard modules the tests use
    without importing them) is imported."""
    _channel["out"], _channel["in"] = os.dup(1), os.fdopen(os.dup(0), "rb")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the tests' prints go nowhere
        os.dup2(null, fd)
    namespace = {"__name__": "__main__"}
    for name in modules:
        with contextlib.suppress(BaseException):
            namespace[name] = __import__(name)
    failed_setup = _run(setup, "<setup>", namespace)
    for name in stand_ins:
        namespace[name] = Remote(["name", name])
    for index, test in enumerate(tests):
        _send(["begin", index])
        verdict, detail = failed_setup or _run(test, f"<test {index}>", namespace) or ("pass", "")
        _send(["end", index, verdict, detail])
    _send(["done"])


def _run(source: str, name: str, namespace: dict) -> tuple[str, str] | None:
    """Runs `source`; returns (verdict, detail) where it raised, None where it did not."""
    try:
        exec(compile(source, name, "exec"), namespace)
    except AssertionError as error:
        return "fail", _detail(error)
    except CodeLost as error:
        return "error", f"the code's process: {error}"
    except (NotPlainData, NotPlain) as error:
        return "error", f"not plain data: {error}"
    except BaseException as error:
        return "error", _detail(error)
    return None


def _detail(error: BaseException) -> str:
    try:
        text = str(error)
    except BaseException:
        text = ""
    return f"{type(error).__name__}: {text}"[:300] if text else type(error).__name__
