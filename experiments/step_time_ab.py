"""Step times of this tree against another commit's, interleaved: did a change make any mode slower?

    python -m experiments.step_time_ab --old 781082b              # CNN2D at 512², 5 rounds
    python -m experiments.step_time_ab --old 781082b --size 1024 --rounds 7

Each measurement runs in a fresh interpreter inside one tree (the old commit checked out in a temporary
git worktree, or this one), through that tree's own harness (``bigconv.harness``): plain PyTorch with 1
thread, the SPMD mode on 2 ranks, the driver mode on 2 workers on each transport and on 1 worker, all of
1 thread (``experiments.bench_core``'s time table). Every round runs every (tree, mode) pair, the trees in
a fresh random order per round, so drift of this shared host falls on both alike. Per mode: the median
over rounds of each tree's best step, their ratio, and the host's spread (the largest relative range of
either tree's per-round figures): a ratio within the spread is no measurable change.

Appends one JSON line per measurement and one summary line to ``--out``; prints a markdown table.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from bigconv.harness import cli

MODES = [
    ("plain", None, 1, "plain PyTorch, 1 thread"),
    ("spmd", "p2p", 2, "SPMD, 2 ranks x 1 thread"),
    ("driver", "p2p", 2, "driver mode (p2p), 2 workers x 1 thread"),
    ("driver", "rpc", 2, "driver mode (rpc), 2 workers x 1 thread"),
    ("driver", "p2p", 1, "driver mode (p2p), 1 worker x 1 thread"),
]

# Run inside a tree: only public names of the harness that both trees have.
MEASURE = """
import json, sys
import bigconv
from bigconv.harness.workload import Workload, plain_in_fresh_process, train_distributed
from bigconv.harness.spmd_workload import train_spmd
kind, transport, n, size, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
w = Workload(model="cnn2d", size=size, steps=steps)
if kind == "plain":
    r = plain_in_fresh_process(w, threads=1)
elif kind == "spmd":
    r = train_spmd(w, n, threads=1)
else:
    with bigconv.World(workers=n, threads_per_worker=1) as world:
        r = train_distributed(w, world, transport=transport)
print("RESULT " + json.dumps({"step_s": r["step_s"], "step_times_s": r["step_times_s"]}))
"""


def measure(tree: str, kind: str, transport, n: int, size: int, steps: int, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, "-c", MEASURE, kind, str(transport), str(n), str(size), str(steps)],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if out.returncode or line is None:
        raise RuntimeError(f"{kind}/{transport}/{n} in {tree} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def old_tree(commit: str, root: str) -> str:
    path = tempfile.mkdtemp(prefix="bigconv-old-")
    subprocess.run(["git", "-C", root, "worktree", "add", "--detach", "-q", path, commit], check=True)
    return path


def main(argv=None) -> None:
    parser = cli.parser("experiments.step_time_ab", __doc__)
    parser.add_argument("--old", required=True, help="the commit to compare against (e.g. 781082b)")
    parser.add_argument("--size", type=int, default=512, help="image edge (CNN2D, one image)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps after one warm-up step")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--seed", type=int, default=0, help="of the per-round order of the trees")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one measurement may take")
    parser.add_argument("--out", default="results/step_time_ab.jsonl", help="results file the records are appended to")
    args = parser.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    old = old_tree(args.old, root)
    trees = {"old": old, "new": root}
    order = random.Random(args.seed)
    best: dict = {(label, t): [] for *_, label in MODES for t in trees}
    base = {"bench": "step_time_ab", "old": args.old, "new": head + ("+dirty" if dirty else ""), "size": args.size,
            "steps": args.steps, "cpus": os.cpu_count()}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    try:
        for rnd in range(args.rounds):
            for kind, transport, n, label in MODES:
                names = list(trees)
                order.shuffle(names)
                for t in names:
                    r = measure(trees[t], kind, transport, n, args.size, args.steps, args.timeout)
                    best[(label, t)].append(r["step_s"])
                    with open(args.out, "a") as fh:
                        fh.write(json.dumps({**base, "kind": "time", "round": rnd, "tree": t, "mode": label,
                                             "load1": os.getloadavg()[0], "time": time.time(), **r}) + "\n")
                    print(f"round {rnd} {label} {t}: {r['step_s']:.3f}s", flush=True)
    finally:
        subprocess.run(["git", "-C", root, "worktree", "remove", "--force", old], check=False)
    med = statistics.median
    print(f"\n| mode | {args.old} (s) | {base['new']} (s) | new / old | host spread |\n|---|---|---|---|---|")
    summary = {}
    for *_, label in MODES:
        o, n = best[(label, "old")], best[(label, "new")]
        spread = max((max(v) - min(v)) / med(v) for v in (o, n))
        summary[label] = {"old": med(o), "new": med(n), "ratio": med(n) / med(o), "spread": spread}
        print(f"| {label} | {med(o):.3f} | {med(n):.3f} | {med(n) / med(o):.3f} | ±{spread / 2:.1%} |")
    with open(args.out, "a") as fh:
        fh.write(json.dumps({**base, "kind": "summary", "rounds": args.rounds, "modes": summary}) + "\n")


if __name__ == "__main__":
    main()
