"""Draw every figure the given results files support (see ``plots.study``; DSN records: ``plots.dsn``).

    python -m plots results/*.jsonl --out figures/

Files without sweep or size-search records (e.g. the core benchmark's, drawn by ``plots.core``)
are passed over with a note.
"""

from __future__ import annotations


from bigconv.harness import records
from plots import dsn, study
from bigconv.harness import cli


def main(argv=None) -> None:
    parser = cli.parser("plots", __doc__)
    parser.add_argument("results", nargs="+", help="JSON-lines results files")
    parser.add_argument("--out", default="figures", help="output folder")
    args = parser.parse_args(argv)
    for path in args.results:
        recs = records.load(path)
        paths = study.draw_file(path, recs, args.out) + dsn.draw_file(path, recs, args.out)
        if not paths:
            print(f"{path}: no sweep or size-search records; skipped")
        for p in paths:
            print(p)


if __name__ == "__main__":
    main()
