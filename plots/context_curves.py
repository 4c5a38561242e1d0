"""Training loss against steps, from the context benchmark's records that carry a ``loss_curve``.

    python -m plots.context_curves results/context_scaled.jsonl --out figures/context_curves

One panel per (task, dial, steps) of the learning-rate trials (the ``val`` split, where every method tried the
same rates), one line per (method, learning rate): the mean loss over each thirtieth of the steps. ln 2 (a
coin's loss) is dashed: a line that stays on it did not learn, whatever its accuracy. Test-split runs are drawn
in panels of their own, one thin line per seed.
"""

from __future__ import annotations

import math

from .context import COLORS, series
from .output import cli, footer, save

STYLES = ("-", "--", ":", "-.")


def _panels(recs: list[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in recs:
        out.setdefault((r.get("task", "order"), r.get("split", "test"), r["dial"], r["steps"]), []).append(r)
    return dict(sorted(out.items()))


def draw(recs: list[dict], stem: str, title: str = "") -> list[str]:
    """Write ``stem``.png and .pdf; the paths (none without runs that carry a loss curve)."""
    recs = [r for r in recs if r.get("bench") == "context" and r.get("record", "run") == "run" and r.get("loss_curve")]
    if not recs:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(recs)
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.9 * rows), squeeze=False, sharey=True)
    for ax, ((task, split, dial, steps), mine) in zip(axes.flat, panels.items()):
        lrs = sorted({r["lr"] for r in mine})
        for r in sorted(mine, key=lambda r: (series(r), r["lr"], r["seed"])):
            curve, line = r["loss_curve"], series(r)  # the accuracy figure's lines, in its colours
            x = [(i + 1) * steps / len(curve) for i in range(len(curve))]
            style = STYLES[lrs.index(r["lr"]) % len(STYLES)] if split == "val" else "-"
            label = f"{line} lr {r['lr']:g}" if split == "val" else line
            ax.plot(x, curve, style, color=COLORS.get(line, "black"), lw=1 if split == "val" else 0.6, label=label)
        ax.axhline(math.log(2), ls="--", color="grey", lw=0.8)
        ax.set_ylim(0, 1.0)
        ax.set_title(f"{task}, dial {dial:g}, {split} ({'trials' if split == 'val' else 'seeds'})", fontsize=8)
        ax.set_xlabel("step", fontsize=8)
        handles, labels = ax.get_legend_handles_labels()
        seen = dict(zip(labels, handles))
        ax.legend(seen.values(), seen.keys(), fontsize=5, loc="best")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("training loss (ln 2 dashed)", fontsize=8)
    r0 = recs[0]
    fig.suptitle(title or f"{r0['image_size']}² images, {r0['tile_size']}² tiles: training loss", fontsize=10)
    footer(fig, r0)
    return save(fig, stem)


def main(argv=None) -> None:
    cli(draw, "figures/context_curves", __doc__, argv)


if __name__ == "__main__":
    main()
