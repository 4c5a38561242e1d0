"""What every figure script here does alike: the provenance footer, writing .png and .pdf, the CLI."""

from __future__ import annotations

import os
from typing import Callable

from bigconv.harness import records
from bigconv.harness.cli import parser as cli_parser


def footer(fig, record: dict) -> None:
    """The commit, torch and core count behind ``record``, in small grey type at the bottom left."""
    fig.text(0.01, 0.005, f"commit {record.get('commit')}, torch {record.get('torch')}, "
             f"{(record.get('env') or {}).get('cores')} cores", fontsize=6, color="grey")


def save(fig, stem: str) -> list[str]:
    """Write ``stem``.png and ``stem``.pdf, close the figure, return the paths."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    paths = [f"{stem}.{ext}" for ext in ("png", "pdf")]
    for path in paths:
        fig.savefig(path, dpi=150)
    plt.close(fig)
    return paths


def cli(draw: Callable[[list, str], list[str]], default_stem: str, doc: str | None, argv=None) -> None:
    """``python -m plots.X RESULTS [--out STEM]``: draw the records of RESULTS, print the paths."""
    parser = cli_parser(f"plots.{getattr(draw, '__module__', 'plots').rpartition('.')[2]}", doc)
    parser.add_argument("results", help="JSON-lines results file")
    parser.add_argument("--out", default=default_stem, help="path stem (.png and .pdf are written)")
    args = parser.parse_args(argv)
    for p in draw(records.load(args.results), args.out):
        print(p)
