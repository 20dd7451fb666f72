"""The command line as the tests drive it: one error line, and its parser without the verbs."""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Callable

import pytest

from onnx_partition import values
from onnx_partition.cli import main
from onnx_partition.cli.args import build_parser

__all__ = ["one_error", "parser_that_never_runs_a_verb", "verb_parsers"]


def one_error(capsys, argv, pattern: str) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert pattern in lines[0], lines[0]
    return lines[0]


def _never(args: argparse.Namespace) -> int:
    pytest.fail(f"a bad value got through: {args}")


def parser_that_never_runs_a_verb() -> argparse.ArgumentParser:
    """The command line's parser (``cli.args.build_parser``, with its numbers checked as
    ``main`` checks them: ``values.install``) whose every verb fails the test: a value that
    got through would otherwise run the verb (the demo takes minutes)."""
    commands: defaultdict[str, Callable[[argparse.Namespace], int]] = defaultdict(
        lambda: _never)
    parser = build_parser(commands)
    values.install(parser)
    return parser


def verb_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each verb's parser, by verb."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)
