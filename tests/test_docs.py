"""The docs keep to the sizes a reader can take in: README.md short, with the main job (export,
partition, train, run) in code on its first screen; no long paragraph in README.md or
docs/design.md; benchmarks by topic, not by issue; every relative link resolving to a file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```[^\n]*\n.*?^```[^\n]*$", re.S | re.M)
ITEM = re.compile(r"^(?:[-*]|\d+\.) ")


def units(text: str) -> list[str]:
    """What a reader takes in one go: each paragraph (lines between blank lines), each list item
    and each table cell, fenced code and headings left out, whitespace collapsed."""
    found: list[str] = []
    for block in re.split(r"\n\s*\n", FENCE.sub("", text)):
        lines = [line for line in block.strip().splitlines() if not line.startswith("#")]
        if not lines:
            continue
        if lines[0].lstrip().startswith("|"):
            for row in lines:
                found += [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]
            continue
        item: list[str] = []
        for line in lines:
            if ITEM.match(line) and item:
                found.append(" ".join(item))
                item = []
            item.append(line.strip())
        found.append(" ".join(item))
    return [" ".join(u.split()) for u in found if u.strip()]


def _longest(path: Path, limit: int) -> list[str]:
    return [f"{len(u)} chars: {u[:80]}..." for u in units(path.read_text()) if len(u) > limit]


def test_units_split_paragraphs_items_and_cells():
    text = ("# Title\n\nOne\nparagraph.\n\n- an item\n  wrapped\n- another\n\n"
            "| a | b |\n| --- | --- |\n| x \\| y | z |\n\n```bash\nnot counted\n```\n")
    assert units(text) == ["One paragraph.", "- an item wrapped", "- another", "a", "b", "---",
                           "---", "x \\| y", "z"]


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines (at most 150)"
    assert not _longest(README, 400), _longest(README, 400)


def test_readme_runs_the_main_job_on_its_first_screen():
    first = "\n".join(README.read_text().splitlines()[:60])
    code = "\n".join(block for lang, block in
                     re.findall(r"^```(\w*)[^\n]*\n(.*?)^```", first, flags=re.S | re.M)
                     if lang == "bash")
    for verb in ("export", "partition", "train", "run"):
        assert re.search(rf"onnx-partition {verb}\b", code), (
            f"no `onnx-partition {verb}` in a bash block of README.md's first 60 lines")


def test_design_paragraphs_are_readable():
    design = ROOT / "docs" / "design.md"
    assert not _longest(design, 1200), _longest(design, 1200)
    assert "| old path |" not in design.read_text()  # no migration table


def test_benchmarks_are_by_topic_not_by_issue():
    headings = [line for line in (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
                if line.startswith("#")]
    named = [h for h in headings if re.search(r"\bissues?\s*#?\d", h, flags=re.I)]
    assert not named, named


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(page):
    text = FENCE.sub("", page.read_text())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        assert path.exists(), f"{page.name}: link to {target} resolves to no file"
