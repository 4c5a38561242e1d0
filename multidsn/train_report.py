"""What ``python -m multidsn.train`` reports: one summary over every seed, its JSON lines, and the table.

A single seed says little: a source-only model's accuracy on a shifted domain depends on its random
start (on the noise target it ranged from 33% to 74% over three seeds), so the margin is judged on
the per-seed gains (DSN minus source-only, same seed, same data) and their spread.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from bigconv.provenance import source_commit


def environment() -> dict:
    commit, dirty = source_commit()
    commit = f"{commit} (dirty)" if dirty else commit
    return {"torch": torch.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "machine": platform.machine(), "processor": platform.processor() or None, "commit": commit}


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(args, cfg, runs: list[dict], argv: list[str]) -> dict:
    """``runs``: one dict per seed, ``{"seed": s, "dsn": result, "source_only": result or None}``.

    The top-level accuracies are means over the seeds; ``per_seed`` keeps each seed's numbers."""
    per_seed, names = [], list(runs[0]["dsn"]["target_accuracy"])
    for run in runs:
        dsn, base = run["dsn"], run["source_only"]
        gain = None
        if base and dsn["mean_target_accuracy"] is not None:
            gain = dsn["mean_target_accuracy"] - base["mean_target_accuracy"]
        per_seed.append({"seed": run["seed"], "dsn": dsn["mean_target_accuracy"],
                         "source_only": base["mean_target_accuracy"] if base else None, "gain": gain,
                         "private_codes_collapsed": dsn["private_codes"]["collapsed"]})
    targets = {}
    for n in names:
        targets[n] = {}
        for model in ("dsn", "source_only"):
            values = [r[model]["target_accuracy"][n] for r in runs if r[model] is not None]
            m, s = mean_std([v for v in values if v is not None])
            targets[n][model] = {"mean": m, "std": s}
    gains = [p["gain"] for p in per_seed if p["gain"] is not None]
    gain, gain_std = mean_std(gains)
    dsn_mean, _ = mean_std([p["dsn"] for p in per_seed if p["dsn"] is not None])
    base_mean, _ = mean_std([p["source_only"] for p in per_seed if p["source_only"] is not None])
    return {"record": "summary", "command": "python -m multidsn.train " + " ".join(argv),
            "targets": args.targets, "placement": args.placement, "decoder": args.decoder, "head": args.head,
            "steps": args.steps, "batch_size": args.batch_size, "optimizer": args.optimizer, "lr": args.lr,
            "normalize": args.normalize, "target_names": names, "seeds": [r["seed"] for r in runs],
            "config": dict(cfg.__dict__),
            "dsn_mean_target_accuracy": dsn_mean, "source_only_mean_target_accuracy": base_mean,
            "gain": gain, "gain_std": gain_std, "gain_min": min(gains) if gains else None,
            "per_target": targets, "per_seed": per_seed,
            "private_codes_collapsed": any(p["private_codes_collapsed"] for p in per_seed), **environment()}


def write(path: str, records: list[dict]) -> None:
    """Append ``records`` as JSON lines, one timestamp for all (a run's lines belong together)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    with open(path, "a") as f:
        f.writelines(json.dumps({"time": stamp, **r}, default=str) + "\n" for r in records)


def report(summary: dict, runs: list[dict]) -> str:
    """The table printed at the end: per target, mean (± std over seeds) of each model; then per seed."""
    models = [m for m in ("dsn", "source_only") if runs[0][m] is not None]
    several = len(runs) > 1
    rows = [f"{'target':<12}" + "".join(f"{m:>18}" for m in models)]
    for n, by_model in summary["per_target"].items():
        rows.append(f"{n:<12}" + "".join(f"{_pct(by_model[m]['mean'], by_model[m]['std'] if several else None):>18}"
                                         for m in models))
    for label, values in (("mean", lambda m: [p[m] for p in summary["per_seed"]]),
                          ("source", lambda m: [r[m]["source_accuracy"] for r in runs])):
        cells = []
        for m in models:
            mean, std = mean_std([v for v in values(m) if v is not None])
            cells.append(f"{_pct(mean, std if several else None):>18}")
        rows.append(f"{label:<12}" + "".join(cells))
    if summary["gain"] is not None:
        per = ", ".join(f"seed {p['seed']} {100 * p['gain']:+.1f}" for p in summary["per_seed"])
        spread = f" ± {100 * summary['gain_std']:.1f} (min {100 * summary['gain_min']:+.1f})" if several else ""
        rows.append(f"gain: {100 * summary['gain']:+.1f} points{spread}; {per}")
    for r in runs:
        codes = r["dsn"]["private_codes"]
        rows.append(f"seed {r['seed']} private codes: {'COLLAPSED' if codes['collapsed'] else 'alive'} "
                    f"(private/shared norm per domain: {', '.join(f'{v:.3f}' for v in codes['norm_ratio'])})")
    return "\n".join(rows)


def _pct(v, std=None) -> str:
    if v is None:
        return "n/a"
    return f"{100 * v:.1f}%" if std is None else f"{100 * v:.1f} ± {100 * std:.1f}%"
