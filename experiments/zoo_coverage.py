"""Run the model zoo (tests/zoo.py) through bigconv against a single process; one JSON line per model.

    python -m experiments.zoo_coverage [--only SUBSTR] [--fast] [--resume] [--out results/zoo.jsonl]
    python -m experiments.zoo_coverage --table results/zoo.jsonl

Each entry is built (seeded, float64) and compared by ``bigconv.verify.compare_training`` on a World
of its worker count and grid (one World per worker count, reused; a broken one is replaced). The
status of a model is

- ``exact``: every error (forward, input_grad, param_grads, loss, weights) <= 1e-9, all replicas
  equal and the state dict keys those of the plain model;
- ``mismatch``: the run completed but some error is larger, or the replicas/keys differ;
- ``refused``: a ``ValueError`` raised by ``parallelize()`` or the dry run (``plan``), i.e. before
  any forward/backward work on the workers;
- ``failed``: anything else (a ``bigconv.WorkerFailure``, or an error after remote work began).

For a mismatch the record also holds ``noise_floor``: the same errors between two single-process
runs whose inputs differ by ~1e-15 relative, i.e. how far rounding alone moves this model and setup
(a mismatch within a few times its noise floor is ill-conditioning, not a decomposition error).

``--table`` prints a Markdown table from the last record of each model, and "N of M exact".
While a model runs, ``<out>.current`` names it: if the driver itself is killed (out of memory), the
next run records that model as ``failed`` first. ``--resume`` skips models already recorded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

from bigconv.compat import allow_torchvision_without_ops

allow_torchvision_without_ops()  # before torchvision, timm, smp (zoo imports them lazily)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from bigconv.provenance import source_commit  # noqa: E402
from bigconv.verify import ERROR_KEYS, NOISE_FACTOR, compare_training  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-9
# Which verdict a record holds. No tag: the old check (one model-wide denominator for gradients, a floor
# of 1e-3 of the state's largest entry for weights). "per-tensor": each tensor against its own size,
# floored by 10x a one-ulp input perturbation's effect (commit d352bee, a few records). "per-tensor/2":
# floored by 100x the effect of one-ulp perturbations of the input and every weight (bigconv.verify now).
METRIC = "per-tensor/2"
# Where bigconv raises a refusal: parallelize() (module checks) and the dry run of ParallelModel.plan.
_REFUSAL_FRAMES = {"parallelize", "__init__", "plan", "_make_plan", "check_modules"}


def load_zoo():
    """tests/zoo.py's ZOO (tests/ is not a package)."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import zoo
    return zoo


def status_of(result: dict) -> str:
    return "exact" if result.get("exact") else "mismatch"


def refused_before_remote_work(exc: BaseException) -> bool:
    """A ValueError (not a WorkerFailure) raised from parallelize()/plan on the driver."""
    import bigconv
    if isinstance(exc, bigconv.WorkerFailure) or not isinstance(exc, ValueError):
        return False
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        code = frame.f_code
        if Path(code.co_filename).name in ("parallel.py", "support.py") and code.co_name in _REFUSAL_FRAMES:
            return True
    return False


def where(exc: BaseException) -> str:
    """The innermost frame of the traceback inside bigconv (or the innermost frame at all)."""
    frames = list(traceback.walk_tb(exc.__traceback__))
    inside = [f for f, _ in frames if "bigconv" in f.f_code.co_filename] or [f for f, _ in frames]
    if not inside:
        return ""
    f = inside[-1]
    return f"{Path(f.f_code.co_filename).name}:{f.f_lineno} {f.f_code.co_name}"


def _finite(value):
    """JSON has no inf or nan: write them as strings."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return repr(value) if isinstance(value, float) and not math.isfinite(value) else value


def _record(entry) -> dict:
    return {"name": entry.name, "library": entry.library, "family": entry.family, "workers": entry.workers,
            "grid": list(entry.grid), "shape": list(entry.shape), "dense": entry.dense, "expect": entry.expect,
            "fast": entry.fast}


def run_entry(entry, world) -> dict:

    record = _record(entry)
    t0 = time.perf_counter()
    try:
        torch.manual_seed(0)
        model = entry.build().double()
        x, y = entry.inputs(torch.Generator().manual_seed(1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = compare_training(model, world, x, y, nn.CrossEntropyLoss(), grid=entry.grid)
        record["metric"] = METRIC
        record["errors"] = _finite({k: r[k] for k in (*ERROR_KEYS, "replicas_equal", "keys_match", "tol")})
        record["worst"] = _finite(r["worst"])
        # Tensors judged against rounding's effect on them rather than their size (near zero or ill-conditioned).
        floored = [t for t in r["tensors"] if t["noise"] * NOISE_FACTOR / r["tol"] > t["scale"]]
        record["noise_floored"] = len(floored)
        # How close the floored tensors came to their bound (NOISE_FACTOR): the margin the factor leaves.
        record["floored_error_over_noise"] = max((t["error"] / t["noise"] for t in floored), default=0.0)
        record["tensors"] = len(r["tensors"])
        record["status"] = status_of(r)
        record["error_type"] = record["error"] = record["where"] = None
    except Exception as exc:  # one model's failure must not stop the sweep
        record["errors"] = None
        record["status"] = "refused" if refused_before_remote_work(exc) else "failed"
        record["error_type"] = type(exc).__name__
        record["error"] = str(exc)[:4000]
        record["where"] = where(exc)
    record["remote_work"] = record["status"] != "refused"
    record["as_expected"] = record["status"] == entry.expect
    record["seconds"] = round(time.perf_counter() - t0, 2)
    record["torch"] = torch.__version__
    record["commit"], record["dirty"] = source_commit()
    record["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return record


def run(args) -> int:
    import bigconv

    zoo = load_zoo()
    only = [o for o in args.only.split(",") if o]
    entries = [e for e in zoo.ZOO if (not only or any(o in e.name for o in only)) and (not args.fast or e.fast)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    current = out.with_name(out.name + ".current")
    if current.exists():  # the previous run died inside this model without recording it
        entry = zoo.BY_NAME.get(current.read_text().strip())
        if entry is not None:
            rec = _record(entry)
            rec.update(status="failed", errors=None, error_type="Killed", remote_work=True, as_expected=False,
                       error="the run ended inside this model without a record (the driver was killed, "
                             "likely out of memory)", where="", seconds=None, torch=torch.__version__,
                       time=time.strftime("%Y-%m-%dT%H:%M:%S"))
            with out.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        current.unlink()
    if args.resume and out.exists():
        done = {json.loads(line)["name"] for line in out.read_text().splitlines() if line.strip()}
        entries = [e for e in entries if e.name not in done]
    if not entries:
        print("no zoo entry left to run", file=sys.stderr)
        return 0
    counts: dict[str, int] = {}
    for workers in sorted({e.workers for e in entries}):
        world = None
        try:
            for entry in (e for e in entries if e.workers == workers):
                if world is None or world.broken:
                    if world is not None:
                        world.close()
                    world = bigconv.World(workers=workers, timeout=args.timeout)
                current.write_text(entry.name)
                rec = run_entry(entry, world)
                with out.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
                current.unlink()
                counts[rec["status"]] = counts.get(rec["status"], 0) + 1
                msg = (rec["error"] or "").splitlines()[0][:160] if rec["error"] else ""
                worst = None
                if rec["errors"]:
                    worst = max((rec["errors"][k] for k in ERROR_KEYS if isinstance(rec["errors"][k], float)),
                                default=0.0)
                print(f"{rec['status']:8s} {entry.name:45s} {rec['seconds']:7.1f}s "
                      f"{'max err %.1e' % worst if worst is not None else msg}", flush=True)
        finally:
            if world is not None:
                world.close()
    print(" ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    return 0


def _note(rec: dict) -> str:
    if rec["status"] == "exact":
        worst = max(rec["errors"][k] for k in ERROR_KEYS)
        return f"max rel. error {worst:.1e}"
    if rec["status"] == "mismatch":
        e = rec["errors"]
        bad = [f"{k} {e[k]:.1e}" if isinstance(e[k], float) else f"{k} {e[k]}" for k in ERROR_KEYS
               if not (isinstance(e[k], float) and e[k] <= TOL)]
        bad += [k for k in ("replicas_equal", "keys_match") if not e.get(k)]
        floor = rec.get("noise_floor")
        if isinstance(floor, dict):
            worst = max(floor[k] for k in ERROR_KEYS)
            bad.append(f"single-process noise floor {worst:.1e}")
        return "; ".join(bad)
    first = (rec.get("error") or "").strip().splitlines()
    text = f"{rec.get('error_type')}: {first[0] if first else ''}"
    return text[:200].replace("|", "\\|")


def table(path: str) -> str:
    records: dict[str, dict] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            records[rec["name"]] = rec  # the last record per model wins
    try:
        order = {e.name: i for i, e in enumerate(load_zoo().ZOO)}
    except Exception:  # the table needs no model libraries
        order = {}
    names = sorted(records, key=lambda n: (order.get(n, len(order)), n))
    lines = ["| model | library | status | note |", "|---|---|---|---|"]
    for n in names:
        rec = records[n]
        status = rec["status"] + ("" if rec.get("as_expected", True) or rec["status"] == "exact" else
                                   f" (expected {rec.get('expect')})")
        lines.append(f"| {n} | {rec['library']} | {status} | {_note(rec)} |")
    exact = sum(r["status"] == "exact" for r in records.values())
    refused_ok = sum(r["status"] == "refused" and r.get("expect") == "refused" for r in records.values())
    lines += ["", f"{exact} of {len(records)} exact" + (f"; {refused_ok} refused as expected" if refused_ok else "")]
    return "\n".join(lines)


README_START, README_END = "<!-- zoo-table -->", "<!-- /zoo-table -->"


def write_readme(readme: str, text: str) -> None:
    """Replace the block between the zoo-table markers of ``readme`` with ``text``."""
    path = Path(readme)
    content = path.read_text()
    start, end = content.index(README_START) + len(README_START), content.index(README_END)
    path.write_text(content[:start] + "\n" + text + "\n" + content[end:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="run only entries whose name contains one of these comma-separated substrings")
    parser.add_argument("--fast", action="store_true", help="run only the fast subset")
    parser.add_argument("--resume", action="store_true", help="skip models already recorded in --out")
    parser.add_argument("--out", default="results/zoo.jsonl", help="JSON lines file to append to")
    parser.add_argument("--timeout", type=float, default=120.0, help="World timeout per wait (seconds)")
    parser.add_argument("--table", metavar="JSONL", help="print a Markdown table of JSONL and exit")
    parser.add_argument("--readme", metavar="MD", help="with --table: write it between the zoo-table markers of MD")
    args = parser.parse_args(argv)
    if args.table:
        text = table(args.table)
        if args.readme:
            write_readme(args.readme, text)
        print(text)
        return 0
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
