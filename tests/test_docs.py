"""The README and docs/ describe the code as it is: a short README that links every page,
links that resolve, and every file path and module they name present."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "BENCHMARKS.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^(?:rlray|jobs|tests|benchmarks|examples|grafana|docs)/[\w/.-]*[\w]$")
MODULE = re.compile(r"^rlray(?:\.\w+)+$")


def anchors(page: Path) -> set[str]:
    """Returns GitHub's anchors of the page's headings."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_the_readme_is_short_and_links_every_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    linked = {Path(target.split("#")[0]).name for target in LINK.findall(readme)}
    assert {page.name for page in PAGES[1:]} <= linked


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_resolves(page: Path):
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        assert path.exists(), f"{page.name}: link to {target}: no such file"
        if anchor:
            assert anchor in anchors(path), f"{page.name}: link to {target}: no such heading"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_path_and_module_named_exists(page: Path):
    for text in CODE.findall(page.read_text()):
        for word in text.split():
            word = word.rstrip(".,:;)").split(":")[0]
            if PATH.match(word):
                assert (REPO / word).exists(), f"{page.name}: {word}: no such file"
            elif MODULE.match(word):
                assert names_something(word), f"{page.name}: {word}: no such module or name"


def names_something(dotted: str) -> bool:
    """Whether `dotted` is a module of rlray, or a name in one."""
    module, name = dotted, None
    while module:
        try:
            found = importlib.import_module(module)
        except ModuleNotFoundError:
            module, _, last = module.rpartition(".")
            name = last if name is None else f"{last}.{name}"
            continue
        for part in name.split(".") if name else []:
            found = getattr(found, part, None)
        return found is not None
    return False


# A measured figure: a decimal number with a unit of time, memory, speed or a ratio
# (ranges such as 1.45-1.47 GiB count both ends). Integers are left out: they are
# mostly settings and shapes (64 tokens, a 10 s timeout), not measurements.
FIGURE = re.compile(
    r"(?<![\w.-])(\d+\.\d+)(?:-(\d+\.\d+))? ?"
    r"(x|%|GiB|MiB|GB|MB|ms|s|tokens/s|episodes/s|programs/s)(?![\w/])"
)


def figures(text: str) -> set[str]:
    """The measured figures a page states in its prose and tables (fenced blocks, which
    quote commands and a run's output, are left out)."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    found = set()
    for low, high, unit in FIGURE.findall(prose):
        found.update(f"{number} {unit}" for number in (low, high) if number)
    return found


@pytest.mark.parametrize("page", PAGES[:-1], ids=lambda p: p.name)
def test_no_page_restates_a_figure_of_the_results_page(page: Path):
    measured = figures((REPO / "BENCHMARKS.md").read_text())
    restated = sorted(figures(page.read_text()) & measured)
    assert not restated, (
        f"{page.name} restates {restated} from BENCHMARKS.md: link to its section instead"
    )


def test_the_results_page_is_short_and_leads_with_its_headlines():
    page = (REPO / "BENCHMARKS.md").read_text()
    assert len(page.splitlines()) <= 300
    first_screen = page.split("\n## ", 1)[0]
    assert first_screen.count("\n| ") >= 5, "no table of headline results before the sections"
    for target in LINK.findall(first_screen):
        if target.startswith("#"):
            assert target[1:] in anchors(REPO / "BENCHMARKS.md"), target


def test_every_benchmark_script_backs_a_claim_on_the_results_page():
    listing = (REPO / "docs" / "benchmarks.md").read_text()
    shared = {"plots.py", "trl_grpo.py"}  # pictures; TRL's side of vs_trl.py
    for script in sorted((REPO / "benchmarks").glob("*.py")):
        if script.name in shared:
            continue
        rows = [line for line in listing.splitlines() if f"`benchmarks/{script.name}" in line]
        assert rows, f"{script.name}: not in docs/benchmarks.md"
        assert all("../BENCHMARKS.md#" in row for row in rows), f"{script.name}: no section"
