"""The shape both command lines (`knnper`, `knnper-edge`) share: one parser class, one error
type for bad input, one way to register a command. A command is a function `run(args) -> int`
and a `Command` naming it, its flags and its help; the console script turns a `UsageError` (or
any error of a bad input) into one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .cli_help import DefaultsHelpFormatter, missing_command_message


class UsageError(Exception):
    """A problem with the command line's inputs, reported as one line; `prog` is the
    (sub-)command whose parser refused it, where a parser did."""

    def __init__(self, message: str, prog: str | None = None) -> None:
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """argparse's parser whose bad flag is a `UsageError`, not a usage block and an exit from
    inside the parser; every option's help shows its default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(missing_command_message(self, message), prog=self.prog)


LAZY_TEXTS = ("help", "description", "epilog")


def no_arguments(parser: argparse.ArgumentParser) -> None:
    """For a command without flags of its own."""


@dataclass(frozen=True)
class Command:
    """One command: its name, the function that runs it, the function that declares its flags,
    and the parser's help texts (`help`, `description`, `epilog`, ...: add_parser's keywords;
    a help text may be a function, called when the parser is built, for one that reads a
    registry)."""

    name: str
    run: Callable[[argparse.Namespace], int]
    arguments: Callable[[argparse.ArgumentParser], None] = no_arguments
    parser_kwargs: tuple[tuple[str, Any], ...] = ()

    def add_to(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        """Its sub-parser, whose `args.func` is `run`."""
        kwargs = {
            key: value() if key in LAZY_TEXTS and callable(value) else value
            for key, value in self.parser_kwargs
        }
        parser = subparsers.add_parser(self.name, **kwargs)
        self.arguments(parser)
        parser.set_defaults(func=self.run)
        return parser


def command(
    name: str,
    run: Callable[[argparse.Namespace], int],
    arguments: Callable[[argparse.ArgumentParser], None] = no_arguments,
    **parser_kwargs: Any,
) -> Command:
    """A `Command`, with add_parser's keywords (help, description, epilog) as keywords."""
    return Command(name, run, arguments, tuple(parser_kwargs.items()))


def add_commands(subparsers: argparse._SubParsersAction, commands: Iterable[Command]) -> None:
    for cmd in commands:
        cmd.add_to(subparsers)
