"""Figures of the tissue context benchmark (issue 54), from its saved records only.

    python -m experiments.context --tissue --report     # prints the table and draws both figures

``draw_curves``: validation loss against steps, a panel per (task, method): every fresh seed's curve (solid, its
kept step marked) and every tuning run's (dotted, one colour per learning rate); ln 2 (a coin's loss) dashed.
``draw_accuracy``: test accuracy per method, a panel per (task, domain): every seed a dot, the mean with its 95%
interval (Student's t over the seeds), chance dashed.
"""

from __future__ import annotations

import math

from multidsn.intervals import interval

from .output import footer, save

METHOD_COLORS = {"whole": "tab:blue", "shrink4": "tab:green", "shrink8": "tab:olive", "tilegrid": "tab:purple",
                 "transmil": "tab:red", "mil": "tab:orange"}
LR_COLORS = ("tab:gray", "tab:cyan", "tab:pink", "tab:brown", "black", "tab:olive")


def _runs(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r.get("bench") == "context_tissue" and r.get("record") == "run" and r.get("val_curve")]


def draw_curves(recs: list[dict], stem: str) -> list[str]:
    """Write ``stem``.png and .pdf; the paths (none without runs)."""
    runs = _runs(recs)
    if not runs:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in runs})
    methods = [m for m in METHOD_COLORS if any(r["method"] == m for r in runs)]
    fig, axes = plt.subplots(len(tasks), len(methods), figsize=(2.9 * len(methods), 2.6 * len(tasks)),
                             squeeze=False, sharey=True, sharex=True)
    for i, task in enumerate(tasks):
        for j, m in enumerate(methods):
            ax = axes[i, j]
            mine = [r for r in runs if r["task"] == task and r["method"] == m]
            lrs = sorted({r["lr"] for r in mine if r["role"] == "tuning"})
            for r in sorted(mine, key=lambda r: (r["role"], r["lr"], r["seed"])):
                steps = [c[0] for c in r["val_curve"]]
                loss = [c[1] for c in r["val_curve"]]
                if r["role"] == "fresh":
                    ax.plot(steps, loss, "-", color=METHOD_COLORS[m], lw=0.7)
                    ax.plot([r["best_step"]], [r["best_val_loss"]], "o", color=METHOD_COLORS[m], ms=2.5)
                else:
                    c = LR_COLORS[lrs.index(r["lr"]) % len(LR_COLORS)]
                    ax.plot(steps, loss, ":", color=c, lw=0.8, label=f"tuning lr {r['lr']:g}")
            ax.axhline(math.log(2), ls="--", color="grey", lw=0.8)
            ax.set_ylim(0, 1.2)
            ax.set_title(f"{task}, {m}", fontsize=8)
            if i == len(tasks) - 1:
                ax.set_xlabel("step", fontsize=8)
            handles, labels = ax.get_legend_handles_labels()
            if labels:
                seen = dict(zip(labels, handles))
                ax.legend(seen.values(), seen.keys(), fontsize=5, loc="upper right")
        axes[i, 0].set_ylabel("validation loss (ln 2 dashed)", fontsize=8)
    r0 = runs[0]
    fig.suptitle(f"{r0['image_size']}² tissue, {r0['tile_size']}² tiles: validation loss (fresh seeds solid, "
                 "kept step dotted; tuning runs dotted)", fontsize=9)
    footer(fig, r0)
    return save(fig, stem)


def draw_accuracy(recs: list[dict], stem: str, chosen: dict | None = None) -> list[str]:
    """Write ``stem``.png and .pdf from the fresh runs (``chosen``: (task, method) -> lr, to keep only those)."""
    runs = [r for r in _runs(recs) if r["role"] == "fresh" and r.get("scores")
            and (chosen is None or chosen.get((r["task"], r["method"])) == r["lr"])]
    if not runs:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in runs})
    domains = ("test", "domain2")
    methods = [m for m in METHOD_COLORS if any(r["method"] == m for r in runs)]
    fig, axes = plt.subplots(len(tasks), 2, figsize=(9, 2.9 * len(tasks)), squeeze=False, sharey=True)
    for i, task in enumerate(tasks):
        for j, d in enumerate(domains):
            ax = axes[i, j]
            for k, m in enumerate(methods):
                acc = [r["scores"][d]["accuracy"] for r in runs if r["task"] == task and r["method"] == m]
                if not acc:
                    continue
                ax.scatter([k] * len(acc), acc, s=9, color=METHOD_COLORS[m], alpha=0.6)
                iv = interval(acc)
                if iv.low is not None:
                    ax.errorbar([k + 0.2], [iv.mean], yerr=[[iv.mean - iv.low], [iv.high - iv.mean]], fmt="s",
                                color=METHOD_COLORS[m], ms=4, capsize=2)
            ax.axhline(0.5, ls="--", color="grey", lw=0.8)
            ax.set_xticks(range(len(methods)), methods, fontsize=7)
            ax.set_ylim(0.3, 1.02)
            ax.set_title(f"{task}, {'test region' if d == 'test' else 'second domain (tiatoolbox)'}", fontsize=8)
        axes[i, 0].set_ylabel("test accuracy", fontsize=8)
    r0 = runs[0]
    fig.suptitle(f"{r0['image_size']}² tissue: accuracy of the kept weights, every seed a dot, mean [95% interval]",
                 fontsize=9)
    footer(fig, r0)
    return save(fig, stem)
