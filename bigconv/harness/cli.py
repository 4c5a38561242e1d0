"""One argument parser for every command-line tool: ``prog`` as the user types it, and every option's
help ending with its default."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's paragraphs; appends ``(default: ...)`` to an option's help unless the help
    already names its default or there is none to name (a flag, an unset option)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("%(default)" in text or "default" in text.lower() or not action.option_strings
                or action.default in (None, False, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"


def plain(doc: str | None) -> str | None:
    """A module docstring as terminal text: reST's double backquotes dropped."""
    return doc.replace("``", "") if doc else doc


def parser(module: str, doc: str | None, **kwargs) -> argparse.ArgumentParser:
    """The parser of ``python -m module``, described by ``doc`` (usually the module's ``__doc__``)."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=plain(doc), formatter_class=HelpFormatter,
                                   **kwargs)
