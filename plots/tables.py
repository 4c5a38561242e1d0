"""Markdown tables of the targets, from saved results only.

    python -m plots.tables results/fig3_cnn2d_quick.jsonl results/fig3_cnn2d_quick_maxsize.jsonl

Sweep files: per-worker peak at the largest size every worker count ran, and single / (N x peak)
against the 0.85 target. Size-search files: the largest edge per worker count against 0.85 N
times one worker's area or volume.
"""

from __future__ import annotations


from bigconv.harness import records
from plots.study import latest_maxsize, memory_ratios, scaling_size
from bigconv.harness import cli

MiB = 2**20


def memory_table(runs: list[dict]) -> list[str]:
    size = scaling_size(runs)
    if size is None:
        return ["(no size that the single process and two worker counts all ran)"]
    ok = {r["workers"]: r for r in runs if r["status"] == "ok" and r["size"] == size}
    ratios = memory_ratios(runs, size)
    dims = runs[0]["dims"]
    rows = [f"{runs[0]['model'].upper()} at {size}{'^' + str(dims) if dims > 1 else ''}, batch {runs[0]['batch']}:",
            "", "| workers | grid | per-worker peak (MiB) | single / N (MiB) | single / (N x peak) | target 0.85 |",
            "|---|---|---|---|---|---|", f"| single process | | {ok[0]['peak_bytes_max'] / MiB:.1f} | | | |"]
    for n, ratio in ratios.items():
        rows.append(f"| {n} | {tuple(ok[n]['grid'] or ())} | {ok[n]['peak_bytes_max'] / MiB:.1f} | "
                    f"{ok[0]['peak_bytes_max'] / n / MiB:.1f} | {ratio:.2f} | {'met' if ratio >= 0.85 else 'missed'} |")
    return rows


def maxsize_table(results: list[dict]) -> list[str]:
    """A markdown table against the target: elements(N) >= 0.85 * N * elements(1 worker)."""
    one = next((r for r in results if r["workers"] == 1 and r["max_elements"]), None)
    rows = ["| workers | largest edge | elements | x 1 worker | target 0.85 N | meets |", "|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: r["workers"]):
        if not r["max_elements"]:
            rows.append(f"| {r['workers'] or 'single process'} | none fits | | | | |")
            continue
        ratio = r["max_elements"] / one["max_elements"] if one else None
        target = 0.85 * r["workers"] if r["workers"] else None
        meets = "" if ratio is None or target is None else ("yes" if ratio >= target else "no")
        rows.append(f"| {r['workers'] or 'single process'} | {r['max_size']} | {r['max_elements']} | "
                    f"{'' if ratio is None else f'{ratio:.2f}'} | {'' if target is None else f'{target:.2f}'} | "
                    f"{meets} |")
    return rows


def main(argv=None) -> None:
    parser = cli.parser("plots.tables", __doc__)
    parser.add_argument("results", nargs="+", help="JSON-lines results files")
    args = parser.parse_args(argv)
    for path in args.results:
        recs = records.load(path)
        print(f"\n{path}\n")
        runs = [r for r in recs if r.get("kind") == "run" and r.get("purpose", "sweep") == "sweep"]
        found = latest_maxsize(recs)
        if runs:
            print("\n".join(memory_table(runs)))
        if found:
            print(f"budget {found[0]['budget_bytes'] / MiB:.0f} MiB per worker, judged by {found[0]['judged_by']}:\n")
            print("\n".join(maxsize_table(found)))


if __name__ == "__main__":
    main()
