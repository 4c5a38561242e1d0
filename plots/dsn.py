"""Figure 7 (DSN) from saved records: lines per case (placement and K), not per worker count.

    python -m plots.dsn results/fig7_dsn_quick.jsonl results/fig7_dsn_quick_maxsize.jsonl --out figures/

- ``<stem>_cases_memory``: peak memory per worker against image size, for the single-process 1S1T DSN
  and for 1S1T, 1S4T and 1S7T in each placement (the study's Figure 7);
- ``<stem>_cases``: (size-search files) the largest image per case, with the single-process edge and the
  2x-area target (its edge x sqrt 2) marked.
"""

from __future__ import annotations

import os
from collections import defaultdict

from bigconv.harness import records
from plots.study import _footer, _plt, _save, latest_maxsize, limit_bytes
from bigconv.harness import cli

MiB = 2**20
_STYLE = {"domain": "-", "encoder": "--"}


def case(rec: dict) -> tuple[str, int]:
    """("single", 1) or (placement, K)."""
    cfg = rec["config"]
    if rec["workers"] == 0:
        return "single", 1
    return cfg.get("placement") or "domain", cfg["targets"]


def case_label(key: tuple[str, int], workers: int | None = None) -> str:
    placement, k = key
    if placement == "single":
        return "1S1T, single process"
    return f"1S{k}T, {placement} placement" + (f" ({workers} workers)" if workers else "")


def _colour(key: tuple[str, int]) -> str:
    return "C0" if key[0] == "single" else {1: "C1", 4: "C2", 7: "C3"}.get(key[1], "C4")


def memory_vs_size(runs: list[dict], source: str, out_dir: str, stem: str) -> list[str]:
    plt = _plt()
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in sorted(runs, key=lambda r: r["size"]):
        if r["status"] == "ok":
            groups[case(r)].append(r)
    if not groups:
        return []
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    for key in sorted(groups, key=lambda k: (k[0] != "single", k)):
        rs = groups[key]
        ax.plot([r["size"] for r in rs], [r["peak_bytes_max"] / MiB for r in rs], "o" + _STYLE.get(key[0], "-"),
                color=_colour(key), lw=2.2 if key[0] == "single" else 1.3, label=case_label(key, rs[0]["workers"]))
    limit, what = limit_bytes(runs[0])
    if limit and limit < 4 * max(r["peak_bytes_max"] for rs in groups.values() for r in rs):
        ax.axhline(limit / MiB, color="k", ls=":", lw=1, label=what)
    sizes = sorted({r["size"] for rs in groups.values() for r in rs})
    ax.set(xscale="log", yscale="log", xlabel="image edge (pixels)", ylabel="peak memory per worker (MiB)",
           title=f"DSN, batch {runs[0]['batch']} per domain: peak memory per worker")
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.minorticks_off()
    ax.legend(fontsize=6.5)
    _footer(fig, [source], runs[0])
    return _save(fig, out_dir, f"{stem}_cases_memory")


def maxsize_by_case(results: list[dict], source: str, out_dir: str, stem: str) -> list[str]:
    found = [r for r in results if r.get("max_size")]
    single = next((r for r in found if r["workers"] == 0), None)
    if not found:
        return []
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    order = sorted(found, key=lambda r: (case(r)[0] != "single", case(r)))
    labels = [case_label(case(r), r["workers"] or None) for r in order]
    ax.barh(range(len(order)), [r["max_size"] for r in order], color=[_colour(case(r)) for r in order])
    for i, r in enumerate(order):
        ax.text(r["max_size"], i, f" {r['max_size']}", va="center", fontsize=7)
    if single:
        ax.axvline(single["max_size"], color="C0", lw=1.5, label="single process")
        ax.axvline(single["max_size"] * 2**0.5, color="k", ls="--", lw=1, label="target: 2x its area")
    ax.set_yticks(range(len(order)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.45 * max([r["max_size"] for r in order] + [single["max_size"] * 2**0.5 if single else 0]))
    ax.set_xlabel("largest image edge (pixels)")
    ax.set_title(f"DSN: largest image within {found[0]['budget_bytes'] / MiB:.0f} MiB per worker", fontsize=10)
    ax.legend(fontsize=7, loc="upper right", framealpha=1)
    _footer(fig, [source], found[0])
    return _save(fig, out_dir, f"{stem}_cases")


def draw_file(path: str, recs: list[dict], out_dir: str) -> list[str]:
    stem = os.path.splitext(os.path.basename(path))[0]
    runs = [r for r in recs if r.get("kind") == "run" and r.get("model") == "dsn"
            and r.get("purpose", "sweep") == "sweep"]
    # A rerun of the search appends its answer again: the last one per case counts.
    found = [r for r in latest_maxsize(recs) if r["model"] == "dsn"]
    return memory_vs_size(runs, path, out_dir, stem) + maxsize_by_case(found, path, out_dir, stem)


def main(argv=None) -> None:
    parser = cli.parser("plots.dsn", __doc__)
    parser.add_argument("results", nargs="+", help="JSON-lines results files of experiments.fig7")
    parser.add_argument("--out", default="figures", help="output folder")
    args = parser.parse_args(argv)
    for path in args.results:
        for p in draw_file(path, records.load(path), args.out) or [f"{path}: no DSN records; skipped"]:
            print(p)


if __name__ == "__main__":
    main()
