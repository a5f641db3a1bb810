"""The command line's reference page, made from the argparse parser itself (cli.build_parser), so
that the docs show exactly the commands, arguments and help texts `paratrain --help` prints."""

from __future__ import annotations

import argparse
from typing import Iterator

from .cli import build_parser


def _commands(parser: argparse.ArgumentParser, name: str
              ) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(the command line, its parser) for the parser and each sub-command below it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _commands(sub, f"{name} {sub_name}")


def _fixed_width(prog: str) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(prog, width=76, max_help_position=28)


def cli_markdown() -> str:
    """One section per command with its `--help` text, at a fixed width."""
    parser = build_parser()
    parser.prog = "paratrain"
    out = ["# Command line", "",
           "Every command and its options, generated from the argument parser "
           "(`paratrain COMMAND --help` prints the same). The config keys that `train`, `plan`, "
           "`bench` and `config show` take as `key=value` are in [Config keys](config.md).", ""]
    for line, sub in list(_commands(parser, "paratrain"))[1:]:
        sub.prog = line
        sub.formatter_class = _fixed_width  # not the width of the terminal that builds the site
        out += [f"## `{line}`", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(out)
