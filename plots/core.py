"""Per-worker peak memory against worker count, from the core benchmark's saved results.

    python -m plots.core results/bench_core.jsonl --out figures/

Measured per-worker peaks are solid; the ideal single / N is dashed in the same colour. The figure
names its source file and hardware.
"""

from __future__ import annotations

import json
import os
from bigconv.harness import cli

MiB = 2**20


def load(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def draw(records: list[dict], source: str, out_dir: str, name: str = "core_memory") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["pdf.fonttype"] = 42  # embed TrueType fonts
    import matplotlib.pyplot as plt

    memory = [r for r in records if r.get("kind") == "memory" and r.get("workers", 0) > 0]
    if not memory:
        raise ValueError(f"{source} holds no distributed memory records")
    single = [r for r in records if r.get("kind") == "memory" and r.get("workers") == 0][-1]["peak_bytes"]
    memory.sort(key=lambda r: r["workers"])
    workers = [r["workers"] for r in memory]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ax.plot(workers, [r["peak_bytes_max"] / MiB for r in memory], "o-", color="C0", label="per-worker peak")
    ax.plot(workers, [single / n / MiB for n in workers], "--", color="C0", label="ideal: single / N")
    ax.axhline(single / MiB, color="C1", label="single process")
    w, env = memory[0]["workload"], memory[0]["env"]
    ax.set(xlabel="workers", ylabel="peak memory (MiB)", xticks=workers,
           title=f"{w['model'].upper()} {w['size']}^{w['model'][3]}, batch {w['batch']}, {w['dtype']}")
    ax.legend()
    fig.text(0.01, 0.01, f"{os.path.basename(source)}; {env['cores']} cores {env['cpu']}, "
             f"GPU {env['gpu']}, torch {env['torch']}", fontsize=6)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{name}.{ext}") for ext in ("png", "pdf")]
    for path in paths:
        fig.savefig(path, dpi=150)
    plt.close(fig)
    return paths


def main(argv=None) -> None:
    parser = cli.parser("plots.core", __doc__)
    parser.add_argument("results", help="JSON-lines results file")
    parser.add_argument("--out", default="figures", help="output folder")
    args = parser.parse_args(argv)
    for path in draw(load(args.results), args.results, args.out):
        print(path)


if __name__ == "__main__":
    main()
