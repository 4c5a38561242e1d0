"""Target accuracy per row of the DSN paper recipe, from ``python -m multidsn.train``'s records.

    python -m plots.dsn_paper results/multidsn_paper.jsonl --out figures/multidsn_paper

One bar per row: the mean over seeds with its 95% interval (Student's t), every seed a dot. A file with
``--tune`` records draws the fresh seeds of each row's chosen setting (settings chosen on the validation
split); otherwise the test lines of the default recipe (``python -m multidsn.train --report``'s table), whose
settings were chosen on the test digits, as the title says.
"""

from __future__ import annotations

from multidsn.intervals import interval
from multidsn.paper import recipe_record, same_recipe
from multidsn.recipes import METHODS, PaperRecipe

from .output import cli, footer, save


def rows(recs: list[dict]) -> tuple[dict[str, list[float]], str]:
    """{method: accuracies} and what they are."""
    fresh = [r for r in recs if r.get("record") == "run" and r.get("seed_role") == "fresh" and "target_acc" in r]
    if fresh:
        out: dict[str, list[float]] = {}
        for r in fresh:
            out.setdefault(r["method"], []).append(r["target_acc"])
        return out, "fresh seeds, settings chosen on the target validation split"
    lines = [r for r in recs if r.get("record") == "run" and r.get("split", "test") == "test" and "target_acc" in r]
    key = recipe_record(PaperRecipe(), [])
    mine = {}
    for r in lines:  # the last line per (method, seed) of the default recipe, as --report keeps
        if r.get("target") == "mnistm" and same_recipe(r.get("recipe"), key, r["method"]):
            mine[r["method"], r["seed"]] = r["target_acc"]
    out = {}
    for (m, _), a in sorted(mine.items()):
        out.setdefault(m, []).append(a)
    return out, "default recipe, settings chosen on these test digits"


def draw(recs: list[dict], stem: str) -> list[str]:
    acc, what = rows(recs)
    if not acc:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = [m for m in METHODS if m in acc]
    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    for i, m in enumerate(order):
        iv = interval(acc[m])
        ax.bar(i, 100 * iv.mean, color=f"C{i}", alpha=0.6)
        if iv.low is not None:
            ax.errorbar(i, 100 * iv.mean, yerr=100 * iv.half, color="k", capsize=4, lw=1)
        ax.scatter([i] * len(acc[m]), [100 * a for a in acc[m]], color="k", s=10, zorder=3)
        top = iv.high if iv.high is not None else iv.mean
        ax.text(i, 100 * top + 1.5, f"{100 * iv.mean:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(order)), order, fontsize=8)
    ax.set_ylabel("target test accuracy (%)")
    ax.set_ylim(0, 100)
    n = sorted({len(acc[m]) for m in order})
    ax.set_title(f"MNIST -> MNIST-M-style: {what}\nmean, 95% interval, each seed a dot (n = "
                 f"{'-'.join(map(str, (n[0], n[-1]))) if len(n) > 1 else n[0]})", fontsize=8)
    footer(fig, next(r for r in recs if r.get("record") == "run"))
    return save(fig, stem)


def main(argv=None) -> None:
    cli(draw, "figures/multidsn_paper", __doc__, argv)


if __name__ == "__main__":
    main()
