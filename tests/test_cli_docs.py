"""docs/cli.md says what the parsers' ``--help`` says: it is what
:mod:`onnx_partition.cli.docs` writes from them now, and every option and help text of every
verb's ``--help`` is in it."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from onnx_partition.cli import docs
from onnx_partition.cli.args import RANK_ENTRIES, rank_parser

PAGE = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def _squeezed(text: str) -> str:
    """Text without whitespace (``--help`` wraps lines, and breaks words after a hyphen)."""
    return re.sub(r"\s+", "", text)


def _help(parser) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    return out.getvalue()


def _sections(page: str) -> dict[str, str]:
    """Each ``## title`` of the page and its text."""
    parts = re.split(r"^## (.+)$", page, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_the_page_is_the_parsers_page():
    assert PAGE.read_text() == docs.render(), (
        f"docs/cli.md differs from the parsers; regenerate it: {docs.REGENERATE}")


def _parsers():
    _, verbs = docs.verb_parsers()
    yield from ((f"onnx-partition {name}", parser) for name, parser in verbs.items())
    yield from ((f"python -m {module}", rank_parser(verb)) for verb, module in
                RANK_ENTRIES.items())


COMMON = {"-h", "--help", "-q", "--quiet", "-v", "--verbose"}  # listed once, atop the page


@pytest.mark.parametrize(("title", "parser"), list(_parsers()),
                         ids=[title for title, _ in _parsers()])
def test_every_option_of_help_is_on_the_page(title, parser):
    section = _sections(PAGE.read_text())[title]
    named = " ".join(re.findall(r"^\| `([^`]+)` \|", section, flags=re.M))
    shown = _help(parser)
    invocations = re.findall(r"^  (\S.*?)(?:\s{2,}|$)", shown, flags=re.M)
    names = {n for inv in invocations for n in
             (re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", inv) if inv.startswith("-")
              else [inv.split()[0]])} - COMMON
    assert len(names) >= 3, shown
    for name in names:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", named), (
            f"{title}: {name} is in --help but not in docs/cli.md; regenerate it: "
            f"{docs.REGENERATE}")
    squeezed = _squeezed(shown)
    for cell in re.findall(r"^\| `[^`]+` \| (.*) \|$", section, flags=re.M):
        text = cell.replace("\\|", "|")
        assert _squeezed(text) in squeezed, (
            f"{title}: {text!r} is not what --help says; regenerate docs/cli.md: "
            f"{docs.REGENERATE}")


def test_a_changed_option_is_caught(monkeypatch):
    page = docs.render()
    monkeypatch.setattr(docs, "build_parser", _with_extra_option(docs.build_parser))
    assert docs.render() != page and "--an-option-added" in docs.render()


def _with_extra_option(build):
    def patched(commands):
        parser = build(commands)
        _, verbs = _subparsers(parser)
        verbs["run"].add_argument("--an-option-added", help="added after the page was written")
        return parser

    return patched


def _subparsers(parser):
    import argparse

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub, sub.choices
