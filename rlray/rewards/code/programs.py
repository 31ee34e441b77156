"""The sources that the two sandboxed processes of a program's tests run.

A sandboxed interpreter has the standard library only (no site-packages, no rlray), so
each source carries the rlray modules it needs and defines them as those modules before
it calls the side's `main`. It carries them compiled (marshal, made once per process),
and as text for an interpreter of another version than this one, which would not read
that.
"""

from __future__ import annotations

import functools
import marshal
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_PACKAGE = "rlray.rewards.code"
_BOOT = f"""\
import sys as _sys
import types as _types
for _name in ("rlray", "rlray.rewards", "{_PACKAGE}"):
    _sys.modules.setdefault(_name, _types.ModuleType(_name))


def _define(name, code):
    module = _types.ModuleType(name)
    _sys.modules[name] = module
    exec(code, module.__dict__)
    return module
"""


@functools.cache
def _prelude(side: str) -> str:
    """Returns the lines that define the boot code, plain.py and the side's module."""
    texts = [("<boot>", _BOOT)] + [
        (f"{_PACKAGE}.{name}", (_HERE / f"{name}.py").read_text()) for name in ("plain", side)
    ]
    compiled = marshal.dumps(tuple(compile(text, name, "exec") for name, text in texts))
    return (
        "import marshal as _marshal\nimport sys as _sys\n"
        f"if _sys.hexversion == {sys.hexversion}:\n"
        f"    _boot, _plain, _side = _marshal.loads({compiled!r})\n"
        "else:\n"
        "    _boot, _plain, _side = (compile(text, name, 'exec') for name, text in "
        f"{texts!r})\n"
        "exec(_boot)\n"
        f"_define({_PACKAGE + '.plain'!r}, _plain)\n"
        f"_side = _define({_PACKAGE + '.' + side!r}, _side)\n"
    )


def code_program(code: str) -> str:
    """Returns the source of the code's process (code_side.py) for `code`."""
    return f"{_prelude('code_side')}_side.main({code!r})\n"


def test_program(setup: str, tests: list[str], stand_ins: list[str], modules: list[str]) -> str:
    """Returns the source of the tests' process (test_side.py)."""
    return f"{_prelude('test_side')}_side.main({setup!r}, {tests!r}, {stand_ins!r}, {modules!r})\n"
