"""Accuracy against the context dial, one line per method, from the context benchmark's saved records.

    python -m plots.context results/context.jsonl --out figures/context

Each method's line is its mean accuracy over seeds; the shaded band is the mean's 95% interval
(Student's t over the seeds, ``multidsn.intervals``; none with one seed) and every seed is a dot. Chance
(0.5) is dashed; the dotted vertical line is one tile. The shrunk image with a stem matched to its input
(``stem`` below 4) is a line of its own (``series``).
"""

from __future__ import annotations


from multidsn.intervals import interval

from .output import cli, footer, save

COLORS = {"whole": "tab:blue", "mil": "tab:orange", "downsampled": "tab:green", "downsampled-matched": "tab:olive",
          "transmil": "tab:red", "tilegrid": "tab:purple"}
LABELS = {"whole": "whole image (bigconv, {p} worker{s})", "mil": "tiles + attention MIL (torchmil ABMIL)",
          "downsampled": "downsampled {k}x per side", "downsampled-matched": "downsampled {k}x, stem stride {stem}",
          "transmil": "tiles + TransMIL (PPEG positions)", "tilegrid": "tile-grid CNN (8x8 tile embeddings)"}


def series(r: dict) -> str:
    """The line a run belongs to: its method, and for ``downsampled`` whether its stem was matched to the shrunk
    input (a stride below 4; records before the stem field had stride 4), so one file holding both is not
    averaged into one line."""
    if r["method"] == "downsampled" and r.get("stem", 4) != 4:
        return "downsampled-matched"
    return r["method"]


def draw(recs: list[dict], stem: str, title: str = "") -> list[str]:
    """Write ``stem``.png and .pdf (``stem``_<task> for each task when the records hold several); the paths
    (none without records). Only test-split runs are drawn (not the learning-rate trials)."""
    recs = [r for r in recs if r.get("bench") == "context" and r.get("record", "run") == "run"
            and r.get("split", "test") == "test"]
    tasks = sorted({r.get("task", "order") for r in recs})
    if len(tasks) > 1:
        return [p for t in tasks for p in draw([r for r in recs if r.get("task", "order") == t], f"{stem}_{t}",
                                               f"{title} task {t}" if title else f"task {t}")]
    if not recs:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (matplotlib.ticker.NullLocator below)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method in COLORS:
        mine = [r for r in recs if series(r) == method]
        if not mine:
            continue
        dials = sorted({r["dial"] for r in mine})
        acc = [[r["accuracy"] for r in mine if r["dial"] == d] for d in dials]
        mean = [sum(a) / len(a) for a in acc]
        p = mine[0]["processes"]
        label = LABELS[method].format(p=p, s="" if p == 1 else "s", k=mine[0].get("shrink"), stem=mine[0].get("stem"))
        lo, hi = min(map(len, acc)), max(map(len, acc))
        seeds = f"{lo} seeds" if lo == hi else f"{lo}-{hi} seeds"
        ax.plot(dials, mean, "-o", color=COLORS[method], label=f"{label} ({seeds})")
        ivs = [interval(a) for a in acc]
        if all(iv.low is not None for iv in ivs):
            ax.fill_between(dials, [iv.low for iv in ivs], [iv.high for iv in ivs], color=COLORS[method],
                            alpha=0.15)
        for d, a in zip(dials, acc):
            ax.scatter([d] * len(a), a, s=8, color=COLORS[method], alpha=0.6)
    ax.axhline(0.5, ls="--", color="grey", lw=1, label="chance")
    ax.axvline(1.0, ls=":", color="grey", lw=1)
    ax.set_xscale("log")
    ticks = sorted({r["dial"] for r in recs} | {1.0})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("distance between the digits (tiles)")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0.3, 1.02)
    r0 = recs[0]
    ax.set_title(title or f"{r0['image_size']}² images, {r0['tile_size']}² tiles", fontsize=10)
    ax.legend(fontsize=7, loc="lower left")
    footer(fig, r0)
    return save(fig, stem)


def main(argv=None) -> None:
    cli(draw, "figures/context", __doc__, argv)


if __name__ == "__main__":
    main()
