"""The largest input that trains within a per-worker memory budget, per worker count, by search.

    python -m experiments.maxsize --model cnn2d --workers 1,2,4,8 --budget 16GiB
    python -m experiments.maxsize --preset fig3_cnn2d --quick    # -> results/fig3_cnn2d_quick_maxsize.jsonl

- GPU: the budget is enforced in every process with ``torch.cuda.set_per_process_memory_fraction``
  (one large GPU stands in for N smaller ones); a size fits when its run ends ``ok``.
- CPU: a size fits when its run ends ``ok`` with every worker's measured peak (RSS above the warm
  idle baseline) within the budget.

Each probe is one configuration in fresh processes (``experiments.runs``), recorded with
``purpose: maxsize``; a rerun reuses the probes already in the file. The search predicts the next
edge from the measured peaks (peak ~ a + b * elements), then brackets and bisects until the edges
that fit and fail are within ``--tolerance`` of each other. One ``maxsize`` record per worker count
holds the answer and its probes. The plain single process (``workers`` 0) is searched too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, replace

from bigconv import progress
from bigconv.harness import records, registry
from bigconv.harness.runner import RunConfig
from experiments.runs import run_fresh
from experiments import presets
from experiments.sweep import int_list, label, parse_amount, summary
from plots.tables import maxsize_table
from bigconv.harness import cli

log = logging.getLogger(__name__)

MiB = 2**20


def fits(rec: dict, budget: int) -> bool:
    if rec["status"] != "ok":
        return False
    return rec["device"] == "cuda" or rec["peak_bytes_max"] <= budget


def predict(probes: dict[int, dict], budget: int, dims: int) -> float | None:
    """The edge whose peak the two nearest measured probes put at the budget (None: no peaks yet)."""
    pts = sorted((s ** dims, r["peak_bytes_max"]) for s, r in probes.items()
                 if r["status"] == "ok" and r.get("peak_bytes_max"))
    if not pts:
        return None
    if len(pts) == 1:
        a, b = 0.0, pts[0][1] / pts[0][0]
    else:
        near = sorted(pts, key=lambda p: abs(p[1] - budget))[:2]
        (e0, p0), (e1, p1) = sorted(near)
        b = (p1 - p0) / (e1 - e0) if e1 != e0 and p1 > p0 else p1 / e1
        a = p1 - b * e1
    return max(1.0, (0.995 * budget - a) / b) ** (1 / dims)


def search(base: RunConfig, budget: int, start: int, *, out: str, tolerance: float = 0.02, max_probes: int = 9,
           runner=run_fresh, echo=print, progress=None) -> dict:
    """Largest fitting edge for ``base.workers``; the ``maxsize`` record (also appended to ``out``).

    ``progress``: a tqdm bar (or None) whose postfix shows the probe running.
    """
    spec = registry.spec(base.model)
    q = spec.edge_multiple(base.depth)
    done = records.recorded_keys(out)
    probes: dict[int, dict] = {}
    size = spec.round_size(start, base.depth)
    for _ in range(max_probes):
        cfg = replace(base, size=size)
        rec = done.get(records.config_key(asdict(cfg)))
        if progress is not None:
            progress.set_postfix_str(f"{base.workers} workers, probe {size}", refresh=True)
        if rec is None:
            echo(f"  probe {label(cfg)} ...")
            rec = {**runner(cfg), "purpose": "maxsize"}
            records.append(out, rec)
        probes[size] = rec
        ok = fits(rec, budget)
        echo(f"  {label(cfg)}: {summary(rec)} -> {'fits' if ok else 'does not fit'}")
        lo = max((s for s, r in probes.items() if fits(r, budget)), default=None)
        hi = min((s for s, r in probes.items() if not fits(r, budget)), default=None)
        step = max(q, int(tolerance * (lo or size)))
        if lo is not None and hi is not None and hi - lo <= step:
            break
        guess = predict(probes, budget, spec.dims)
        if lo is not None and hi is not None:
            nxt = guess if guess is not None and lo + step <= guess <= hi - step else (lo + hi) / 2
            if hi - lo <= 2 * step:
                nxt = lo + step
        elif lo is not None:  # only fits so far: go up, at least a step
            nxt = max(guess or 2 * lo, lo + step)
        else:  # only failures: go down
            nxt = min(guess or hi / 2, hi * 0.7) if guess is None or guess < hi else hi * 0.7
        size = spec.round_size(int(nxt), base.depth)
        if size in probes:  # rounding landed on a known edge
            size = size + q if lo is not None and size <= lo else max(q, size - q)
            if size in probes:
                break
    lo = max((s for s, r in probes.items() if fits(r, budget)), default=None)
    hi = min((s for s, r in probes.items() if not fits(r, budget)), default=None)
    best = probes.get(lo) if lo else None
    result = {"kind": "maxsize", "model": base.model, "dims": spec.dims, "batch": base.batch,
              "workers": base.workers, "device": base.device, "budget_bytes": budget,
              "judged_by": "cuda_memory_fraction" if base.device == "cuda" else "measured_peak_rss",
              "max_size": lo, "max_elements": lo ** spec.dims if lo else None, "first_failing_size": hi,
              "peak_bytes_at_max": best["peak_bytes_max"] if best else None,
              "probes": [{"size": s, "status": r["status"], "peak_bytes_max": r.get("peak_bytes_max"),
                          "fits": fits(r, budget)} for s, r in sorted(probes.items())],
              "config": asdict(base), "env": (best or next(iter(probes.values())))["env"],
              "torch": (best or next(iter(probes.values())))["torch"],
              "commit": (best or next(iter(probes.values())))["commit"], "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    records.append(out, result)
    return result


def main(argv=None) -> None:
    parser = cli.parser("experiments.maxsize", __doc__)
    parser.add_argument("--preset", choices=sorted(presets.PRESETS),
                        help="a study figure's configuration (sets model, workers and budget)")
    parser.add_argument("--quick", action="store_true", help="the preset's 2-core CPU scale")
    parser.add_argument("--model", choices=sorted(registry.MODELS), default=None,
                        help="a benchmark model (instead of --preset)")
    parser.add_argument("--workers", type=int_list, default=None, help="worker counts, e.g. 1,2,4,8")
    parser.add_argument("--budget", type=parse_amount, default=None, help="per-worker memory, e.g. 16GiB")
    parser.add_argument("--start", type=parse_amount, default=None, help="first edge to probe (default: a guess)")
    parser.add_argument("--out", default=None, help="default results/<preset or model>[_quick]_maxsize.jsonl")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain single-process search")
    parser.add_argument("--batch", type=int, default=None, help="images per step (default: the preset's, else 1)")
    parser.add_argument("--width", type=int, default=16, help="conv channels")
    parser.add_argument("--depth", type=int, default=3, help="conv blocks")
    parser.add_argument("--steps", type=int, default=1, help="training steps per probe")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"],
                        help="where workers run (default: cuda if available)")
    parser.add_argument("--tolerance", type=float, default=0.02, help="relative edge precision")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per probe")
    progress.add_arguments(parser)
    args = parser.parse_args(argv)
    progress.setup(args)
    scale = presets.preset(args.preset).scale(args.quick) if args.preset else None
    model = presets.preset(args.preset).model if args.preset else args.model
    if model is None:
        parser.error("give --preset or --model")
    workers = args.workers or (scale.maxsize_workers if scale else [1, 2, 4, 8])
    budget = args.budget or (scale.budget_bytes if scale else None)
    if budget is None:
        parser.error("give --budget (e.g. 16GiB)")
    import torch

    device = args.device or (scale.device if scale else ("cuda" if torch.cuda.is_available() else "cpu"))
    out = args.out or f"results/{args.preset or model}{'_quick' if args.quick else ''}_maxsize.jsonl"
    spec = registry.spec(model)
    start = args.start or (min(scale.sizes) if scale else 64 * spec.edge_multiple(args.depth))
    base = RunConfig(model=model, workers=0, size=spec.round_size(start, args.depth), batch=args.batch or
                     (scale.batch if scale else 1), width=args.width, depth=args.depth, steps=args.steps,
                     device=device, budget_bytes=budget if device == "cuda" else None, timeout_s=args.timeout)
    log.info("%s: largest input within %.0f MiB per worker on %s, workers %s -> %s", model, budget / MiB, device,
             workers, out)
    results, prev = [], None
    counts = ([] if args.no_plain else [0]) + sorted(set(workers) - {0})
    with progress.bars_and_logs(), progress.bar(len(counts), "size search", args, unit="search") as pb:
        echo = log.debug if not pb.disable else log.info
        for n in counts:
            guess = start if prev is None else int(prev["max_size"] * (n / max(1, prev["workers"])) ** (1 / spec.dims))
            r = search(replace(base, workers=n), budget, guess, out=out, tolerance=args.tolerance, echo=echo,
                       progress=pb)
            log.info("%s: largest %s (first failing %s)", "single process" if n == 0 else f"{n} workers",
                     r["max_size"], r["first_failing_size"])
            pb.update(1)
            results.append(r)
            if r["max_size"] and n:
                prev = r
    print("\n".join(maxsize_table(results)))


if __name__ == "__main__":
    main()
