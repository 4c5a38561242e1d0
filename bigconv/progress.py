"""Progress bars and log levels for the command-line tools.

Bars are drawn by the driver only (workers never import this), on stderr, and only when stderr is a
terminal: a log file or CI gets the log lines alone. Library code logs through ``logging``; the
CLIs choose the level with ``--quiet`` (warnings and results only) or ``--verbose`` (every step).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from typing import Iterator

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", action="store_true", help="no progress bars; warnings and results only")
    group.add_argument("-v", "--verbose", action="store_true", help="a log line for every configuration or step")


def level(args: argparse.Namespace) -> int:
    if getattr(args, "quiet", False):
        return logging.WARNING
    return logging.DEBUG if getattr(args, "verbose", False) else logging.INFO


def setup(args: argparse.Namespace, fmt: str = "%(message)s") -> None:
    """Log to stderr at the level ``--quiet``/``--verbose`` ask for (our loggers only, not torch's)."""
    logging.basicConfig(level=logging.WARNING, format=fmt, datefmt="%H:%M:%S", stream=sys.stderr, force=True)
    for name in ("bigconv", "multidsn", "experiments", "plots", "__main__"):
        logging.getLogger(name).setLevel(level(args))


def bar(total: int | None, desc: str, args: argparse.Namespace | None = None, unit: str = "it") -> tqdm:
    """A bar on stderr, drawn only on a terminal and never with ``--quiet``."""
    quiet = bool(args is not None and getattr(args, "quiet", False))
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=True,
                disable=True if quiet else None)


@contextlib.contextmanager
def bars_and_logs() -> Iterator[None]:
    """Log lines print above a live bar instead of through it."""
    with logging_redirect_tqdm():
        yield
