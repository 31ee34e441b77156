"""Plain data: the only values that cross between the code's process and the tests'.

A plain value is one of the exact builtin types None, bool, int, float, complex, str,
bytes, or a list, tuple, set, frozenset or dict of plain values, nested at most
MAX_DEPTH deep. `encode` turns one into JSON-able [type name, payload] pairs, `decode`
turns those back; both compare types by identity, so a subclass (an int whose `__eq__`
always holds) is not plain, and neither calls a method that a value's own class
defines. Floats cross as hex, so every bit (NaN, infinities, -0.0) survives.

`reference` lets a caller put something else in a value's place: a stand-in for one of
the code's objects crosses as ["ref", what reference returned].

This module imports only the standard library: it also runs in the sandboxes
(rlray.rewards.code.programs).
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing itself is not imported: a sandbox's start pays for each import
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

MAX_DEPTH = 100

_ATOMS: dict[type, tuple[str, Callable[[Any], Any]]] = {
    type(None): ("NoneType", lambda value: None),
    bool: ("bool", lambda value: value),
    int: ("int", hex),
    float: ("float", float.hex),
    complex: ("complex", lambda value: [value.real.hex(), value.imag.hex()]),
    str: ("str", lambda value: value),
    bytes: ("bytes", bytes.hex),
}
_CONTAINERS = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}


class NotPlain(TypeError):
    """A value that is not plain data, or a payload that does not encode one."""


def encode(value: Any, reference: Callable[[Any], Any] | None = None, depth: int = 0) -> list:
    """Returns `value` as [type name, payload]; raises NotPlain for what is not plain data
    (where `reference` is given, such a value becomes ["ref", reference(value)])."""
    if depth > MAX_DEPTH:
        raise NotPlain("nested too deep")
    kind = type(value)
    if kind in _ATOMS:
        name, payload = _ATOMS[kind]
        return [name, payload(value)]
    if kind in _CONTAINERS:
        return [_CONTAINERS[kind], [encode(item, reference, depth + 1) for item in value]]
    if kind is dict:
        return [
            "dict",
            [
                [encode(key, reference, depth + 1), encode(item, reference, depth + 1)]
                for key, item in dict.items(value)
            ],
        ]
    if reference is not None:
        return ["ref", reference(value)]
    raise NotPlain(f"{kind.__name__} is not plain data")


def _exact(kind: type) -> Callable[[Any], Any]:
    def check(payload: Any) -> Any:
        if type(payload) is not kind:
            raise NotPlain(f"expected {kind.__name__}, got {type(payload).__name__}")
        return payload

    return check


_DECODERS: dict[str, Callable[[Any], Any]] = {
    "NoneType": _exact(type(None)),
    "bool": _exact(bool),
    "int": lambda payload: int(_exact(str)(payload), 16),
    "float": lambda payload: float.fromhex(_exact(str)(payload)),
    "complex": lambda payload: complex(*(float.fromhex(_exact(str)(p)) for p in payload)),
    "str": _exact(str),
    "bytes": lambda payload: bytes.fromhex(_exact(str)(payload)),
}
_BUILDERS = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}


def decode(tagged: Any, reference: Callable[[Any], Any] | None = None, depth: int = 0) -> Any:
    """Returns the value that `tagged` (from `encode`) stands for; raises NotPlain for
    anything else. ["ref", x] becomes reference(x) where `reference` is given."""
    if depth > MAX_DEPTH:
        raise NotPlain("nested too deep")
    try:
        tag, payload = _exact(list)(tagged)
        if tag in _BUILDERS:
            items = (decode(item, reference, depth + 1) for item in _exact(list)(payload))
            return _BUILDERS[tag](items)
        if tag == "dict":
            pairs = [_exact(list)(pair) for pair in _exact(list)(payload)]
            return {
                decode(key, reference, depth + 1): decode(item, reference, depth + 1)
                for key, item in pairs
            }
        if tag == "complex" and len(_exact(list)(payload)) != 2:
            raise NotPlain("a complex number has two parts")
        if tag == "ref" and reference is not None:
            return reference(payload)
        return _DECODERS[tag](payload)
    except NotPlain:
        raise
    except (KeyError, TypeError, ValueError, OverflowError) as error:
        raise NotPlain(f"not an encoded plain value: {error}") from None
