"""The help formatter both command lines (`knnper`, `knnper-edge`) share, so each option's help
ends with its default once, and only where there is one to show."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """argparse's ArgumentDefaultsHelpFormatter, less its noise: no "(default: None)" (a
    required option, or one whose help says what leaving it out does), no "(default: False)"
    on a switch, and nothing added to a help text that already states its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            not action.option_strings
            or action.required
            or action.default is None
            or action.default is argparse.SUPPRESS
            or isinstance(action.default, bool)
            or "default" in text.lower()
        ):
            return text
        return f"{text} (default: %(default)s)"

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        """Paragraphs reflow as argparse's do; lines indented by two spaces (the examples of
        `examples`) stay as written, so a command can be pasted from the help."""
        out: list[str] = []
        paragraph: list[str] = []

        def flush() -> None:
            if paragraph:
                out.append(
                    super(DefaultsHelpFormatter, self)._fill_text(
                        " ".join(paragraph), width, indent
                    )
                )
                paragraph.clear()

        for line in text.splitlines():
            if line.startswith("  ") and line.strip():
                flush()
                out.append(indent + line)
            elif not line.strip():
                flush()
                out.append("")
            else:
                paragraph.append(line.strip())
        flush()
        return "\n".join(out)


def examples(*commands: str, note: str = "") -> str:
    """An epilog with commands to paste (one per line) and an optional sentence after them."""
    text = "example" + ("s" if len(commands) > 1 else "") + ":\n"
    text += "\n".join(f"  {c}" for c in commands)
    return text + (f"\n\n{note}" if note else "")


def missing_command_message(parser: argparse.ArgumentParser, message: str) -> str:
    """argparse names a missing sub-command by its internal dest ("required: where"), a word
    the usage never shows; say which commands there are instead."""
    for action in parser._actions:
        if (
            isinstance(action, argparse._SubParsersAction)
            and message.startswith("the following arguments are required:")
            and (action.metavar or action.dest) in message
        ):
            return f"a command is needed: {', '.join(action.choices)} (see {parser.prog} --help)"
    return message


def package_version() -> str:
    """The installed distribution's version, for both commands' --version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("knnper")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


def install_hint(extra: str) -> str:
    """How to add an extra: the package is not on PyPI, so `pip install knnper[x]` cannot
    work; a clone or a built wheel can."""
    return f"pip install '.[{extra}]' in a knnper clone (or the built wheel with [{extra}])"
