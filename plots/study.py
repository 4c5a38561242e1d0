"""The study's figures, from saved sweep and size-search records only (never by re-running).

Per results file:

- ``<stem>_memory``: peak memory per worker against input size, one line per worker count plus
  the single process, out-of-memory runs marked x, the device-memory limit (or the budget) dashed;
- ``<stem>_util``: average utilization against input size (the study's style);
- ``<stem>_scaling``: memory per worker against worker count at the largest size every worker
  count ran, with the ideal single / N dashed in the same colour;
- ``<stem>_maxsize`` (size-search files): the largest trainable edge against worker count, with
  the ideal sqrt(N) (2D), cbrt(N) (3D) or N (1D) growth from one worker dashed.

Every figure is written as PNG and as PDF with embedded TrueType fonts, and its footer names its
source file, hardware, torch version and commit.
"""

from __future__ import annotations

import os
from collections import defaultdict

MiB = 2**20
GiB = 2**30


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["pdf.fonttype"] = 42  # embed TrueType fonts
    matplotlib.rcParams["ps.fonttype"] = 42
    import matplotlib.pyplot as plt

    return plt


def hardware(rec: dict) -> str:
    env = rec.get("env", {})
    gpu = (f"{env.get('gpu_count', 1)}x {env['gpu']} ({env.get('gpu_memory_bytes', 0) / GiB:.0f} GiB)"
           if env.get("gpu") else "no GPU")
    host = f", {env['host_memory_bytes'] / GiB:.0f} GiB RAM" if env.get("host_memory_bytes") else ""
    commit = f", commit {env.get('commit')}{' (dirty)' if env.get('commit_dirty') else ''}"
    return (f"{env.get('cpu_model') or env.get('cpu')}, {env.get('cores')} cores{host}; {gpu}; "
            f"device {rec.get('device')}; torch {env.get('torch')}{commit}")


def _footer(fig, sources: list[str], rec: dict) -> None:
    fig.text(0.01, 0.005, f"{', '.join(sorted(set(sources)))}\n{hardware(rec)}", fontsize=5.5, va="bottom")


def _save(fig, out_dir: str, name: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    paths = [os.path.join(out_dir, f"{name}.{ext}") for ext in ("png", "pdf")]
    for path in paths:
        fig.savefig(path, dpi=150)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return paths


def run_mode(rec: dict) -> str:
    """``"driver"`` or ``"spmd"``: how a run's workers ran (the plain run is the baseline of both)."""
    return (rec.get("config") or {}).get("mode") or "driver"


def _who(workers: int, mode: str = "driver") -> str:
    if workers == 0:
        return "single process (no RPC)"
    return f"{workers} {'SPMD rank' if mode == 'spmd' else 'worker'}{'s' * (workers > 1)}"


def _mode_of(runs: list[dict]) -> str:
    return next((run_mode(r) for r in runs if r["workers"]), "driver")


def _colour(workers: int, counts: list[int]) -> str:
    return "C0" if workers == 0 else f"C{1 + [n for n in counts if n].index(workers) % 9}"


def _size_label(rec: dict) -> str:
    return {1: "input length", 2: "image edge (pixels)", 3: "volume edge (voxels)"}[rec["dims"]]


def limit_bytes(rec: dict) -> tuple[int | None, str]:
    """The memory limit to mark: the enforced budget, else the device's (or host's) memory."""
    env = rec.get("env", {})
    if rec.get("budget_bytes"):
        return rec["budget_bytes"], f"budget {rec['budget_bytes'] / MiB:.0f} MiB"
    if rec.get("device") == "cuda" and env.get("gpu_memory_bytes"):
        return env["gpu_memory_bytes"], f"device memory {env['gpu_memory_bytes'] / GiB:.0f} GiB"
    if env.get("host_memory_bytes"):
        return env["host_memory_bytes"], f"host memory {env['host_memory_bytes'] / GiB:.0f} GiB"
    return None, ""


def _title(rec: dict, what: str) -> str:
    return f"{rec['model'].upper()}, batch {rec['batch']}, {rec['config']['dtype']}: {what}"


def by_workers(runs: list[dict]) -> dict[int, list[dict]]:
    groups: dict[int, list[dict]] = defaultdict(list)
    for r in sorted(runs, key=lambda r: r["size"]):
        groups[r["workers"]].append(r)
    return dict(sorted(groups.items()))


def memory_vs_size(runs: list[dict], source: str, out_dir: str, stem: str) -> list[str]:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    groups = by_workers(runs)
    counts = list(groups)
    for n, rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok"]
        ax.plot([r["size"] for r in ok], [r["peak_bytes_max"] / MiB for r in ok], "o-", color=_colour(n, counts),
                lw=2.2 if n == 0 else 1.4, label=_who(n, _mode_of(runs)))
    limit, what = limit_bytes(runs[0])
    failed = [r for r in runs if r["status"] == "oom"]
    top = limit / MiB if limit else max(r.get("peak_bytes_max") or 0 for r in runs) / MiB
    for r in failed:
        ax.plot(r["size"], top, "x", color=_colour(r["workers"], counts), ms=8, mew=2)
    if limit:
        ax.axhline(limit / MiB, color="k", ls="--", lw=1, label=what + (" (x: out of memory)" if failed else ""))
    ax.set(xscale="log", yscale="log", xlabel=_size_label(runs[0]), ylabel="peak memory per worker (MiB)",
           title=_title(runs[0], "peak memory"))
    ax.set_xticks(sorted({r["size"] for r in runs}), [str(s) for s in sorted({r["size"] for r in runs})])
    ax.minorticks_off()
    ax.legend(fontsize=7)
    _footer(fig, [source], runs[0])
    return _save(fig, out_dir, f"{stem}_memory")


def util_vs_size(runs: list[dict], source: str, out_dir: str, stem: str) -> list[str]:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    groups = by_workers(runs)
    counts = list(groups)
    for n, rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok" and r.get("util_mean_percent") is not None]
        ax.plot([r["size"] for r in ok], [r["util_mean_percent"] for r in ok], "o-", color=_colour(n, counts),
                lw=2.2 if n == 0 else 1.4, label=_who(n, _mode_of(runs)))
    src = {r.get("util_source") for r in runs if r.get("util_source")}
    what = "GPU utilization (NVML)" if src == {"nvml_gpu"} else "CPU busy share of its threads"
    ax.set(xscale="log", xlabel=_size_label(runs[0]), ylabel=f"average {what} (%)", ylim=(0, None),
           title=_title(runs[0], "average utilization per worker"))
    ax.set_xticks(sorted({r["size"] for r in runs}), [str(s) for s in sorted({r["size"] for r in runs})])
    ax.minorticks_off()
    ax.legend(fontsize=7)
    _footer(fig, [source], runs[0])
    return _save(fig, out_dir, f"{stem}_util")


def scaling_size(runs: list[dict]) -> int | None:
    """The largest size at which the single process and at least two worker counts ran ok."""
    ok = [r for r in runs if r["status"] == "ok"]
    sizes = sorted({r["size"] for r in ok}, reverse=True)
    for s in sizes:
        at = {r["workers"] for r in ok if r["size"] == s}
        if 0 in at and len(at - {0}) >= 2:
            return s
    return None


def memory_ratios(runs: list[dict], size: int) -> dict[int, float]:
    """single / (N x per-worker peak) at ``size``, per worker count N: the memory target's figure."""
    ok = {r["workers"]: r for r in runs if r["status"] == "ok" and r["size"] == size}
    single = ok[0]["peak_bytes_max"]
    return {n: single / (n * r["peak_bytes_max"]) for n, r in sorted(ok.items()) if n}


def memory_vs_workers(runs: list[dict], source: str, out_dir: str, stem: str) -> list[str]:
    size = scaling_size(runs)
    if size is None:
        return []
    plt = _plt()
    ok = {r["workers"]: r for r in runs if r["status"] == "ok" and r["size"] == size}
    single = ok[0]["peak_bytes_max"]
    ns = [n for n in sorted(ok) if n]
    ratios = memory_ratios(runs, size)
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    ax.plot(ns, [ok[n]["peak_bytes_max"] / MiB for n in ns], "o-", color="C1", label="per-worker peak (measured)")
    ax.plot(ns, [single / n / MiB for n in ns], "--", color="C1", label="ideal: single / N")
    ax.axhline(single / MiB, color="C0", lw=2.2, label="single process (no RPC)")
    for n in ns:
        ax.annotate(f"{ratios[n]:.2f}", (n, ok[n]["peak_bytes_max"] / MiB), textcoords="offset points",
                    xytext=(4, 4), fontsize=7)
    dims = runs[0]["dims"]
    ax.set(xscale="log", yscale="log", xlabel="workers", ylabel="peak memory per worker (MiB)",
           title=_title(runs[0], f"memory vs workers at {size}" + (f"^{dims}" if dims > 1 else "")))
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.minorticks_off()
    ax.legend(fontsize=7, title="labels: single / (N x peak)", title_fontsize=7)
    _footer(fig, [source], runs[0])
    return _save(fig, out_dir, f"{stem}_scaling")


def maxsize_vs_workers(results: list[dict], source: str, out_dir: str, stem: str) -> list[str]:
    """``results``: ``maxsize`` records of one model and budget."""
    plt = _plt()
    dist = sorted((r for r in results if r["workers"] > 0 and r.get("max_size")), key=lambda r: r["workers"])
    plain = [r for r in results if r["workers"] == 0 and r.get("max_size")]
    if not dist:
        return []
    dims = dist[0]["dims"]
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    ns = [r["workers"] for r in dist]
    ax.plot(ns, [r["max_size"] for r in dist], "o-", color="C1", label="largest trainable (measured)")
    one = next((r for r in dist if r["workers"] == 1), None)
    if one:
        root = {1: "N", 2: "sqrt(N)", 3: "cbrt(N)"}[dims]
        ax.plot(ns, [one["max_size"] * n ** (1 / dims) for n in ns], "--", color="C1",
                label=f"ideal: 1 worker x {root}")
    if plain:
        ax.axhline(plain[-1]["max_size"], color="C0", lw=2.2, label="single process (no RPC)")
    budget = dist[0]["budget_bytes"]
    ax.set(xscale="log", yscale="log", xlabel="workers", ylabel=f"largest {_size_label(dist[0])}",
           title=f"{dist[0]['model'].upper()}, batch {dist[0]['batch']}: largest input within "
                 f"{budget / MiB:.0f} MiB per worker")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.minorticks_off()
    ax.legend(fontsize=7)
    _footer(fig, [source], dist[0])
    return _save(fig, out_dir, f"{stem}_maxsize")


def latest_maxsize(recs: list[dict]) -> list[dict]:
    """The ``maxsize`` records, the last one per model, worker count, budget, device and batch: a
    rerun of a search appends its answer again (from the same probes, or more of them)."""
    latest: dict[tuple, dict] = {}
    for r in recs:
        if r.get("kind") == "maxsize":
            cfg = r.get("config") or {}
            key = (r["model"], r["workers"], r["budget_bytes"], r.get("device"), r.get("batch"), cfg.get("targets"),
                   cfg.get("placement"))
            latest[key] = r
    return list(latest.values())


def draw_file(path: str, recs: list[dict], out_dir: str) -> list[str]:
    """Every figure the records of one results file support."""
    stem = os.path.splitext(os.path.basename(path))[0]
    # DSN runs are cases (targets, placement), not worker counts: plots.dsn draws them.
    runs = [r for r in recs if r.get("kind") == "run" and r.get("purpose", "sweep") == "sweep"
            and r.get("model") != "dsn"]
    # DSN searches are one case per (targets, placement), not a line over workers: plots.dsn draws them.
    found = [r for r in latest_maxsize(recs) if (r.get("config") or {}).get("targets") is None]
    paths = []
    modes = sorted({run_mode(r) for r in runs if r["workers"]}) or ["driver"]
    for model in sorted({r["model"] for r in runs}):
        for mode in modes:  # one set of figures per mode, each against the same plain baseline
            mine = [r for r in runs if r["model"] == model and (r["workers"] == 0 or run_mode(r) == mode)]
            name = stem if len({r["model"] for r in runs}) == 1 else f"{stem}_{model}"
            name += f"_{mode}" if len(modes) > 1 and mode != "driver" else ""
            if any(r["status"] == "ok" for r in mine):
                paths += memory_vs_size(mine, path, out_dir, name) + util_vs_size(mine, path, out_dir, name)
                paths += memory_vs_workers(mine, path, out_dir, name)
    for model in sorted({r["model"] for r in found}):
        name = stem if len({r["model"] for r in found}) == 1 else f"{stem}_{model}"
        paths += maxsize_vs_workers([r for r in found if r["model"] == model], path, out_dir, name)
    return paths
