"""Memory, step time and largest edge of each alternative, from ``experiments.alternatives``' records.

    python -m plots.alternatives results/alternatives.jsonl --out figures/alternatives

Three panels, one bar per row (method x processes): per-process peak at the fixed size, step time
at that size, and the largest square edge that trains within the budget. Bars of rows whose weights
matched plain PyTorch (rel_err <= 1e-9 in float64) are solid, the others hatched.
"""

from __future__ import annotations


from .output import cli, footer, save

MiB = 2**20
EXACT = 1e-9


def draw(recs: list[dict], stem: str) -> list[str]:
    recs = [r for r in recs if r.get("bench") == "alternatives" and r.get("peak_bytes")]
    if not recs:
        return []
    latest = {}
    for r in recs:  # the last record of each row
        latest[(r["method"], r["processes"])] = r
    recs = list(latest.values())
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{r['method']}\n×{r['processes']}" for r in recs]
    colors = ["tab:blue" if r["method"].startswith("bigconv") else "tab:grey" for r in recs]
    hatches = ["" if (r.get("rel_err") is not None and r["rel_err"] <= EXACT) else "//" for r in recs]
    edge_key = "max_edge_1gib" if any(r.get("max_edge_1gib") for r in recs) else "max_edge_budget"
    budget = recs[0].get("max_edge_budget_bytes")
    panels = [("peak per process (MiB)", [r["peak_bytes"] / MiB for r in recs]),
              ("step (s)", [r["step_s"] or 0 for r in recs]),
              (f"largest edge within {budget / MiB:.0f} MiB" if budget else "largest edge",
               [r.get(edge_key) or 0 for r in recs])]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    for ax, (label, values) in zip(axes, panels):
        bars = ax.bar(range(len(recs)), values, color=colors)
        for b, h in zip(bars, hatches):
            b.set_hatch(h)
        ax.set_xticks(range(len(recs)), names, fontsize=6.5, rotation=45, ha="right")
        ax.set_title(label, fontsize=10)
    r0 = recs[0]
    fig.suptitle(f"{r0['model']}, {r0['size']}², float32, 1 thread per process "
                 f"(hatched: weights not equal to plain within {EXACT:g} in float64)", fontsize=9)
    footer(fig, r0)
    return save(fig, stem)


def main(argv=None) -> None:
    cli(draw, "figures/alternatives", __doc__, argv)


if __name__ == "__main__":
    main()
