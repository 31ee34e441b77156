"""The layer rules import-linter cannot say (`make lint` runs this after its contracts in
pyproject.toml):

- torch, transformers and vLLM are not loaded at import time by any module of the
  driver's side (core, driver, cluster, episodes, observe, agent) and the simulator:
  each package is imported whole in a fresh interpreter, and what it loaded is read
  from sys.modules;
- a function-level import has its reason beside it (a comment on its line or the line
  above): a torch-free process, an optional dependency, a child process. Imports that
  only dodged a cycle have no place left.

    python tests/check_layers.py          # exits 1 naming every break, 0 when none
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "rlray"
TORCH_FREE = ("core", "driver", "cluster", "episodes", "observe", "agent", "simulator")
HEAVY = ("torch", "transformers", "vllm")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def heavy_imports_at_import_time(package: str) -> list[str]:
    """Returns the heavy packages importing every module of rlray.<package> loads."""
    modules = sorted(module_name(p) for p in (PACKAGE / package).rglob("*.py"))
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    if result.returncode != 0:
        return [f"(import failed: {result.stderr.strip().splitlines()[-1]})"]
    return json.loads(result.stdout.strip().splitlines()[-1])


def unexplained_lazy_imports(path: Path) -> list[str]:
    """Returns "file:line: import" for each function-level import without a comment on
    its line or the line above."""
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            line, above = lines[node.lineno - 1], lines[node.lineno - 2].strip()
            if "#" not in line and not above.startswith("#"):
                where = path.relative_to(REPO)
                found.append(f"{where}:{node.lineno}: {line.strip()}")
    return sorted(set(found))


def breaks() -> list[str]:
    """Returns every break of the two rules, one line each."""
    found = []
    for package in TORCH_FREE:
        for heavy in heavy_imports_at_import_time(package):
            found.append(f"rlray.{package} loads {heavy} at import time")
    for path in sorted(PACKAGE.rglob("*.py")):
        for line in unexplained_lazy_imports(path):
            found.append(f"{line} (a function-level import needs its reason in a comment)")
    return found


if __name__ == "__main__":
    problems = breaks()
    for problem in problems:
        print(problem)
    print(f"layer rules: {len(problems)} broken" if problems else "layer rules: kept")
    sys.exit(1 if problems else 0)
