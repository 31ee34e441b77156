"""The house rules a maintainer can check at a glance: no class with more than 25
methods, no `__init__` over 40 lines (jobs/ppo.py on one screen is
tests/test_job_skeleton.py's). Classes that grow past them split along their seams."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(REPO / "rlray").rglob("*.py"), *(REPO / "jobs").glob("*.py")])
MAX_METHODS = 25
MAX_INIT_LINES = 40


def classes() -> list[tuple[str, ast.ClassDef]]:
    found = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), filename=str(path))
        where = path.relative_to(REPO)
        found += [(f"{where}:{n.name}", n) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    return found


def methods(node: ast.ClassDef) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    return [item for item in node.body if isinstance(item, kinds)]


def test_no_class_has_more_than_25_methods():
    overfull = {name: len(methods(n)) for name, n in classes() if len(methods(n)) > MAX_METHODS}
    assert not overfull, overfull


def test_no_init_is_longer_than_40_lines():
    long = {
        name: m.end_lineno - m.lineno + 1
        for name, n in classes()
        for m in methods(n)
        if m.name == "__init__" and m.end_lineno - m.lineno + 1 > MAX_INIT_LINES
    }
    assert not long, long
