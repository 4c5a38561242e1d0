"""Draw every figure the given results files support, and name why a file gets none.

    python -m plots results/*.jsonl --out figures/

Sweep and size-search records: ``plots.study`` (DSN cases: ``plots.dsn``); the context benchmark:
``plots.context`` (and ``plots.context_curves`` for its runs that carry a loss curve); the one-device
alternatives: ``plots.alternatives``; the core benchmark's memory records: ``plots.core``; the DSN paper
recipe (``python -m multidsn.train``): ``plots.dsn_paper``. A file none of them draws is named with the kinds
of records it holds, which have no figure (their tables are printed by the command that wrote them, see docs/
and benchmarks/).
"""

from __future__ import annotations

import os
from collections import Counter

from bigconv.harness import cli, records
from plots import alternatives, context, context_curves, core, dsn, dsn_paper, study


def draw_file(path: str, recs: list[dict], out_dir: str) -> list[str]:
    """Every figure of one results file (none: see ``why_not``)."""
    stem = os.path.join(out_dir, os.path.splitext(os.path.basename(path))[0])
    paths = study.draw_file(path, recs, out_dir) + dsn.draw_file(path, recs, out_dir)
    paths += context.draw(recs, stem) + context_curves.draw(recs, f"{stem}_curves")
    paths += alternatives.draw(recs, stem)
    if any(r.get("kind") == "memory" and r.get("bench") == "core" and r.get("workers", 0) > 0 for r in recs) \
            and any(r.get("kind") == "memory" and r.get("workers") == 0 for r in recs):
        paths += core.draw(recs, path, out_dir, name=f"{os.path.basename(stem)}_memory")
    paths += dsn_paper.draw(recs, stem)
    return paths


def why_not(recs: list[dict]) -> str:
    """Why no figure: what the file holds."""
    if not recs:
        return "the file holds no records"
    kinds = Counter(str(r.get("bench") or r.get("kind") or r.get("record") or "unlabelled") for r in recs)
    return ("no figure is made for its records (" + ", ".join(f"{k} x{n}" for k, n in kinds.most_common())
            + "); their tables come from the command that wrote them")


def main(argv=None) -> None:
    parser = cli.parser("plots", __doc__)
    parser.add_argument("results", nargs="+", help="JSON-lines results files")
    parser.add_argument("--out", default="figures", help="output folder")
    args = parser.parse_args(argv)
    for path in args.results:
        if not os.path.exists(path):
            print(f"{path}: no such file; skipped")
            continue
        recs = records.load(path)
        paths = draw_file(path, recs, args.out)
        if not paths:
            print(f"{path}: skipped: {why_not(recs)}")
        for p in paths:
            print(p)


if __name__ == "__main__":
    main()
