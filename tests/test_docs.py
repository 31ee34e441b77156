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
