"""What runs in the code's sandbox: the code, then its answers to requests, one line each.

Each request names one of the code's values and asks one thing of it:

    ["value", target]                 the value itself
    ["attr", target, name]            getattr(value, name)
    ["item", target, key]             value[key]
    ["call", target, args, kwargs]    value(*args, **kwargs)
    ["list", target]                  list(value): an iterator's items, a generator's

where target is ["name", a name the code defines] or ["handle", n] (the nth value this
process answered with a handle), and args, kwargs and key are plain data
(rlray.rewards.code.plain) in which ["ref", target] stands for one of the code's values.
Each answer is ["value", plain data], ["handle", n] for what is not plain data, or
["raised", the builtin exception class it derives from, its message]. Its first line is
["ready", null], or the builtin exception class that defining the code raised.

Every answer is a claim of the code's: it owns this process and can write whatever it
likes where the answers go. Nothing here is a defence; the defence is what this process
is never given (rlray.rewards.code).

This module imports only the standard library and rlray.rewards.code.plain, which the
sandbox's program defines (rlray.rewards.code.programs).
"""

from __future__ import annotations

import json
import os

from rlray.rewards.code.plain import NotPlain, decode, encode

MAX_MESSAGE = 500  # characters kept of an exception's message


def main(code: str) -> None:
    """Defines `code`, then answers requests from stdin until it closes."""
    answers, requests = os.dup(1), os.fdopen(os.dup(0), "rb")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the code's own reads find nothing, its prints go nowhere
        os.dup2(null, fd)
    namespace = {"__name__": "solution"}  # not __main__: its own main block stays unrun
    handles: list = []
    _write(answers, ["ready", _load(code, namespace)])
    for line in requests:
        _write(answers, _answer(json.loads(line), namespace, handles))


def _load(code: str, namespace: dict) -> str | None:
    try:
        exec(compile(code, "<solution>", "exec"), namespace)
    except BaseException as error:
        return _builtin_base(error)
    return None


def _answer(request: list, namespace: dict, handles: list) -> list:
    kind, target, *rest = request

    def value_of(target: list):
        where, key = target
        if where == "handle":
            return handles[key]
        if key not in namespace:
            raise NameError(f"name {key!r} is not defined")
        return namespace[key]

    try:
        value = value_of(target)
        if kind == "attr":
            value = getattr(value, rest[0])
        elif kind == "item":
            value = value[decode(rest[0], value_of)]
        elif kind == "call":
            value = value(*decode(rest[0], value_of), **decode(rest[1], value_of))
        elif kind == "list":
            value = list(value)
    except BaseException as error:
        return ["raised", _builtin_base(error), _message(error)]
    try:
        return ["value", encode(value)]
    except NotPlain:
        handles.append(value)
        return ["handle", len(handles) - 1]


def _builtin_base(error: BaseException) -> str:
    return next(c.__name__ for c in type(error).__mro__ if c.__module__ == "builtins")


def _message(error: BaseException) -> str:
    try:
        return str(error)[:MAX_MESSAGE]
    except BaseException:
        return ""


def _write(fd: int, message: list) -> None:
    data = memoryview(json.dumps(message).encode() + b"\n")
    while data:
        data = data[os.write(fd, data) :]
