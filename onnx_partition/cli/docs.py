"""docs/cli.md, the command line's reference, written from the parsers themselves
(:func:`onnx_partition.cli.args.build_parser` and :func:`~onnx_partition.cli.args.rank_parser`),
so it says what ``--help`` says: each verb's description and every option, grouped as ``--help``
groups them, with its help and default as ``--help`` shows them. Regenerate it after changing an
option::

    .venv/bin/python -m onnx_partition.cli.docs docs/cli.md

(without a path it prints the page). ``tests/test_cli_docs.py`` fails when the file differs.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from onnx_partition.cli.args import RANK_ENTRIES, build_parser, rank_parser

__all__ = ["REGENERATE", "WIDTH", "render", "verb_parsers"]

#: The command that rewrites docs/cli.md, from the repository's root.
REGENERATE = ".venv/bin/python -m onnx_partition.cli.docs docs/cli.md"
#: The help formatter's width (fixed, so the page does not depend on the terminal).
WIDTH = 100
#: Options every verb takes, listed once at the top instead of under each verb.
_COMMON = ("-h", "-q", "-v")

_HEAD = f"""# Command line reference

Every verb of `onnx-partition` and of its two torchrun entries, each option as its `--help`
prints it. Generated from the parsers (`onnx_partition/cli/args.py`); do not edit by hand, run
`{REGENERATE}` (`tests/test_cli_docs.py` fails when this page and the parsers differ).
Task by task: [guide.md](guide.md); the files the verbs read and write: [files.md](files.md).
"""


def _never(args: argparse.Namespace) -> int:
    raise RuntimeError("the reference's parser runs no verb")


def verb_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command's parser and each verb's, in the order ``--help`` lists them."""
    commands: defaultdict[str, Callable[[argparse.Namespace], int]] = defaultdict(
        lambda: _never)
    parser = build_parser(commands)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, dict(sub.choices)


def _formatter(parser: argparse.ArgumentParser) -> argparse.HelpFormatter:
    make: Callable[..., argparse.HelpFormatter] = parser.formatter_class
    return make(prog=parser.prog, width=WIDTH)


def _invocation(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    """How ``--help`` names an option (``-o OUTPUT, --output OUTPUT``), spelt here the same on
    every Python (3.13's argparse shortened its own form)."""
    if not action.option_strings:
        return str(formatter._metavar_formatter(action, action.dest)(1)[0])
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    value = formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
    return ", ".join(f"{flag} {value}" for flag in action.option_strings)


def _cell(text: str) -> str:
    """One line of a Markdown table cell: whitespace collapsed, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _rows(parser: argparse.ArgumentParser, actions: Sequence[argparse.Action],
          skip: Sequence[str]) -> list[str]:
    formatter = _formatter(parser)
    rows = []
    for action in actions:
        if action.help == argparse.SUPPRESS or set(action.option_strings) & set(skip):
            continue
        invocation = _invocation(formatter, action)
        rows.append(f"| `{_cell(invocation)}` | {_cell(formatter._expand_help(action))} |")
    return rows


def _section(level: str, title: str, parser: argparse.ArgumentParser,
             skip: Sequence[str] = _COMMON) -> list[str]:
    """A heading, the parser's description, and a table per option group."""
    lines = [f"{level} {title}", ""]
    if parser.description:
        lines += [" ".join(parser.description.split()), ""]
    for group in parser._action_groups:
        rows = _rows(parser, group._group_actions, skip)
        if not rows:
            continue
        lines += [f"**{group.title}**", "", "| option | what it does |", "| --- | --- |",
                  *rows, ""]
    return lines


def render() -> str:
    """docs/cli.md as the parsers describe the command line now."""
    parser, verbs = verb_parsers()
    top = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    summary = {a.dest: a.help for a in top._choices_actions}
    lines = [_HEAD, "| verb | what it does |", "| --- | --- |"]
    lines += [f"| [`{name}`](#onnx-partition-{name}) | {_cell(summary[name] or '')} |"
              for name in verbs]
    lines += ["", *_section("##", "onnx-partition", parser, skip=("-h",))]
    lines += ["Every verb also takes `-q/--quiet` and `-v/--verbose` (after the verb too) "
              "and `-h/--help`.", ""]
    for name, verb in verbs.items():
        lines += _section("##", f"onnx-partition {name}", verb)
    for entry, module in RANK_ENTRIES.items():
        lines += _section("##", f"python -m {module}", rank_parser(entry), skip=("-h",))
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Write the page to the path given, else print it."""
    args = list(sys.argv[1:] if argv is None else argv)
    text = render()
    if args:
        Path(args[0]).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
