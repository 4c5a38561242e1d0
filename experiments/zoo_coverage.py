"""Run the model zoo (tests/zoo.py) through bigconv against a single process; one JSON line per model.

    python -m experiments.zoo_coverage [--only SUBSTR] [--fast] [--resume] [--out results/zoo.jsonl]
    python -m experiments.zoo_coverage --table results/zoo.jsonl [--doc docs/zoo.md]

Each entry is built (seeded, float64) and compared by ``bigconv.verify.compare_training`` on a World
of its worker count and grid (one World per worker count, reused; a broken one is replaced). The
status of a model is

- ``exact``: ``compare_training``'s verdict (``bigconv.verify``): every tensor (the output, the input
  gradient, each parameter's gradient, each step's loss, each weight and buffer after the steps) within
  1e-9 of its own size, but residues (zero in exact arithmetic: rounding on both sides, within 10 times
  what reordering the sums moves them by in one process), integer buffers equal, all replicas equal and
  the state dict keys those of the plain model;
- ``ill-conditioned``: nothing is further off than rounding explains, but rounding alone moves some
  tensor past 1e-9 of its size at the entry's input size; the record names the tensors, and the entry is
  run again at the size ``bigconv.verify.conditioned_size`` names (``rerun``: its shape and status);
- ``mismatch``: the run completed but some tensor is further off, or the replicas/keys differ;
- ``refused``: a ``ValueError`` raised by ``parallelize()`` or the dry run (``plan``), i.e. before
  any forward/backward work on the workers;
- ``failed``: anything else (a ``bigconv.WorkerFailure``, or an error after remote work began).

A record names the worst tensor of each kind (``worst``: its error, own size and noise), how many
tensors are residues (``residues``) and which are ill-conditioned (``ill_conditioned``), how close
those came to their bound (``worst_error_over_noise``, at most ``NOISE_FACTOR``), the check that judged
it (``metric``) and the commit.

``--table`` prints a Markdown table: each model's verdict under the current check and every other
record it has, mismatches and failures named and dated (records are only ever appended).
While a model runs, ``<out>.current`` names it: if the driver itself is killed (out of memory), the
next run records that model as ``failed`` first. ``--resume`` skips models already recorded under
the current check.
"""

from __future__ import annotations

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

from bigconv.harness import cli
from bigconv.provenance import source_commit  # noqa: E402
from bigconv.verify import ERROR_KEYS, compare_training, conditioned_size  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-9
# Which verdict a record holds. No tag: the old check (one model-wide denominator for gradients, a floor
# of 1e-3 of the state's largest entry for weights). "per-tensor": each tensor against its own size,
# floored by 10x a one-ulp input perturbation's effect (commit d352bee, a few records). "per-tensor/2":
# floored by 100x the effect of one-ulp perturbations of the input and every weight. "per-tensor/3": the
# same, and a running mean also against the square root of its running variance. "per-tensor/4": the second
# perturbed run takes the batch in reverse order. "verdict/5": exact / ill-conditioned / not exact, the noise
# measured by runs that only reorder sums (channels-last, reversed batch) from fresh copies, no floor for the
# output, input gradient and losses, residues within 10x their noise. "verdict/6": the same, a tensor judged
# against its own size only where 10x its noise is within 1e-9 of it. "verdict/7": exact within 1e-9 where
# rounding alone stays within it, ill-conditioned past 1e-9 within 10x the noise (the output, input gradient
# and losses too), negligible residues (1024 ulps of the largest of their kind), a running mean against the
# spread it averages. "verdict/8": no floor but residues the noise runs leave undetermined (a third noise run,
# mirrored sums, where the first two leave a small tensor bit-identical), optimizer state judged, workers'
# disagreements named (bigconv.verify now).
METRIC = "verdict/8"
# Where bigconv raises a refusal: parallelize() (module checks) and the dry run of ParallelModel.plan.
_REFUSAL_FRAMES = {"parallelize", "__init__", "plan", "_make_plan"}


def load_zoo():
    """tests/zoo.py's ZOO (tests/ is not a package)."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import zoo
    return zoo


def status_of(result: dict) -> str:
    return {"exact": "exact", "ill-conditioned at this size": "ill-conditioned"}.get(result["verdict"], "mismatch")


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


def _compare(model, world, x, y, entry) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = compare_training(model, world, x, y, nn.CrossEntropyLoss(), grid=entry.grid)
    r.pop("net", None)
    return r


def _target(entry, y, x):
    """The entry's targets for an input ``x`` of another size: labels per image stay, a dense map is drawn anew
    (as tests/test_zoo.py does)."""
    if not entry.dense:
        return y
    return torch.randint(0, entry.num_classes, (x.shape[0], *x.shape[2:]), generator=torch.Generator().manual_seed(5))


def _verdict_fields(r: dict) -> dict:
    """What a record keeps of a verdict."""
    judged = [t for t in r["tensors"] if t["status"] in ("residue", "ill-conditioned") and t["noise"] > 0]
    return {"status": status_of(r), "verdict": r["verdict"],
            "errors": _finite({k: r[k] for k in (*ERROR_KEYS, "replicas_equal", "keys_match", "tol")}),
            "worst": _finite(r["worst"]), "tensors": len(r["tensors"]), "residues": len(r["residues"]),
            "ill_conditioned": [f"{t['category']}:{t['tensor']}" for t in r["ill_conditioned"]][:20],
            "ill_conditioned_count": len(r["ill_conditioned"]), "reorderings": r["reorderings"],
            # How close residues and ill-conditioned tensors came to their bound (NOISE_FACTOR x their noise).
            "worst_error_over_noise": max((t["error"] / t["noise"] for t in judged), default=0.0),
            "wrong": _finite([{k: t[k] for k in ("category", "tensor", "rel", "error", "scale", "noise", "status")}
                              for t in r["wrong"][:5]])}


def run_entry(entry, world, commit: tuple | None = None) -> dict:
    record = _record(entry)
    record["metric"] = METRIC  # refusals too: they were made by this code, under this check
    t0 = time.perf_counter()
    try:
        torch.manual_seed(0)
        model = entry.build().double()
        x, y = entry.inputs(torch.Generator().manual_seed(1))
        r = _compare(model, world, x, y, entry)
        record.update(_verdict_fields(r))
        if record["status"] == "ill-conditioned":  # again, where one process pins every tensor down
            torch.manual_seed(0)
            size = conditioned_size(entry.build().double(), x, lambda inp: _target(entry, y, inp),
                                    nn.CrossEntropyLoss())
            record["rerun"] = {"shape": list(size) if size else None, "status": None}
            if size:
                torch.manual_seed(0)
                model = entry.build().double()
                xs = torch.randn(size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
                record["rerun"].update(_verdict_fields(_compare(model, world, xs, _target(entry, y, xs), entry)))
        record["error_type"] = record["error"] = record["where"] = None
    except Exception as exc:  # one model's failure must not stop the sweep
        record["errors"] = None
        record["status"] = "refused" if refused_before_remote_work(exc) else "failed"
        record["error_type"] = type(exc).__name__
        record["error"] = str(exc)[:4000]
        record["where"] = where(exc)
    record["remote_work"] = record["status"] != "refused"
    rerun_exact = record.get("rerun", {}).get("status") == "exact"
    record["as_expected"] = record["status"] == entry.expect or (entry.expect == "exact" and rerun_exact)
    record["seconds"] = round(time.perf_counter() - t0, 2)
    record["torch"] = torch.__version__
    # The code this process loaded (read at its start), not the tree when the record is written.
    record["commit"], record["dirty"] = commit or source_commit()
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
    if args.resume and out.exists():  # models already recorded under the current check
        done = {r["name"] for r in map(json.loads, filter(str.strip, out.read_text().splitlines()))
                if r.get("metric") == METRIC}
        entries = [e for e in entries if e.name not in done]
    if not entries:
        print("no zoo entry left to run", file=sys.stderr)
        return 0
    counts: dict[str, int] = {}
    commit = source_commit()
    for workers in sorted({e.workers for e in entries}):
        world = None
        try:
            for entry in (e for e in entries if e.workers == workers):
                if world is None or world.broken:
                    if world is not None:
                        world.close()
                    world = bigconv.World(workers=workers, timeout=args.timeout)
                current.write_text(entry.name)
                rec = run_entry(entry, world, commit)
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


METRIC_NAMES = {None: "old check", "per-tensor": "per-tensor, input noise", "per-tensor/2": "per-tensor, no spread",
                "per-tensor/3": "per-tensor, no reversed batch", "per-tensor/4": "per-tensor, one-ulp floors",
                "verdict/5": "verdict, no noise margin", "verdict/6": "verdict, 10x noise margin",
                "verdict/7": "verdict, 1024-ulp floor", METRIC: "verdict"}


def _note(rec: dict) -> str:
    if rec.get("rerun"):
        again = rec["rerun"]
        return (f"{rec.get('ill_conditioned_count', 0)} tensors ill-conditioned at {_x(rec['shape'])}; at "
                f"{_x(again['shape']) if again['shape'] else '(no size found)'}: {again['status']}")
    if rec["status"] in ("exact", "mismatch") and rec.get("metric") and rec.get("worst"):
        # Each category's worst tensor against its own size (or its noise floor), named.
        tol = rec["errors"].get("tol", TOL)
        shown = [k for k in ERROR_KEYS if rec["worst"].get(k) and not _within(rec["errors"][k], tol)]
        if rec["status"] == "exact" or not shown:
            shown = [max((k for k in ERROR_KEYS if rec["worst"].get(k)), key=lambda k: _value(rec["errors"][k]))]
        parts = [f"{k} {_value(rec['errors'][k]):.1e} ({rec['worst'][k]['tensor']})" for k in shown]
        parts += [k.replace("_", " ") + " false" for k in ("replicas_equal", "keys_match") if not rec["errors"].get(k)]
        return "; ".join(parts)
    if rec["status"] in ("exact", "mismatch"):
        e = rec["errors"]
        keys = [k for k in ERROR_KEYS if k in e]  # records before the verdict judged optimizer state have none
        if rec["status"] == "exact":
            return f"max rel. error {max(e[k] for k in keys):.1e}"
        bad = [f"{k} {_value(e[k]):.1e}" for k in keys if not _within(e[k], TOL)]
        return "; ".join(bad + [k for k in ("replicas_equal", "keys_match") if not e.get(k)])
    first = (rec.get("error") or "").strip().splitlines()
    text = f"{rec.get('error_type')}: {first[0] if first else ''}"
    return text[:200].replace("|", "\\|")


def _x(shape) -> str:
    return "x".join(map(str, shape))


def _value(v) -> float:
    return float(v)  # records write inf and nan as strings


def _within(v, tol: float) -> bool:
    return _value(v) <= tol


def _history(recs: list[dict], current: dict) -> str:
    """Every other record of a model: counts per (check, status), and each one that was not exact, dated."""
    counts: dict[tuple, int] = {}
    bad = []
    for r in recs:
        if r is current:
            continue
        key = (METRIC_NAMES.get(r.get("metric"), r.get("metric")), r["status"])
        counts[key] = counts.get(key, 0) + 1
        if r["status"] not in ("exact", "refused") or r.get("as_expected") is False:
            bad.append(f"{r['status']} {(r.get('time') or '')[:10]} ({key[0]}): {_note(r)}")
    text = ", ".join(f"{m}: {s} x{n}" for (m, s), n in counts.items())
    return "; ".join(([text] if text else []) + bad).replace("|", "\\|")[:400]


def table(path: str) -> str:
    """Markdown: each model's verdict under the current check (its last record of METRIC, else its last
    record) and, beside it, every other record it has, with each mismatch or failure named and dated."""
    records: dict[str, list[dict]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            records.setdefault(rec["name"], []).append(rec)
    try:
        order = {e.name: i for i, e in enumerate(load_zoo().ZOO)}
    except Exception:  # the table needs no model libraries
        order = {}
    names = sorted(records, key=lambda n: (order.get(n, len(order)), n))
    lines = ["| model | library | check | status | worst tensor (error against its own size) | other records |",
             "|---|---|---|---|---|---|"]
    current = {}
    for n in names:
        recs = records[n]
        rec = current[n] = next((r for r in reversed(recs) if r.get("metric") == METRIC), recs[-1])
        status = rec["status"] + ("" if rec.get("as_expected", True) or rec["status"] == "exact" else
                                   f" (expected {rec.get('expect')})")
        check = METRIC_NAMES.get(rec.get("metric"), rec.get("metric"))
        lines.append(f"| {n} | {rec['library']} | {check} | {status} | {_note(rec)} | {_history(recs, rec)} |")
    latest = [r for r in current.values() if r.get("metric") == METRIC]
    exact = sum(r["status"] == "exact" for r in latest)
    ill = [r for r in latest if r["status"] == "ill-conditioned"]
    ill_ok = sum(r.get("rerun", {}).get("status") == "exact" for r in ill)
    refused_ok = sum(r["status"] == "refused" and r.get("expect") == "refused" for r in latest)
    earlier_bad = sum(r is not current[n] and (r["status"] not in ("exact", "refused") or r.get("as_expected") is False)
                      for n in names for r in records[n])
    lines += ["", f"Under the current check: {exact} of {len(latest)} models recorded exact"
              + (f", {len(ill)} ill-conditioned at their size ({ill_ok} of them exact when rerun at the size "
                 "bigconv.verify.conditioned_size names)" if ill else "")
              + (f", {refused_ok} refused as expected" if refused_ok else "")
              + f"; {len(names) - len(latest)} models not yet recorded under it. "
              f"{sum(len(v) for v in records.values())} records in all; {earlier_bad} earlier records were not "
              "exact or not as expected (listed per model)."]
    return "\n".join(lines)


DOC_START, DOC_END = "<!-- zoo-table -->", "<!-- /zoo-table -->"


def write_doc(doc: str, text: str) -> None:
    """Replace the block between the zoo-table markers of ``doc`` with ``text``."""
    path = Path(doc)
    content = path.read_text()
    start, end = content.index(DOC_START) + len(DOC_START), content.index(DOC_END)
    path.write_text(content[:start] + "\n" + text + "\n" + content[end:])


def main(argv=None) -> int:
    parser = cli.parser("experiments.zoo_coverage", __doc__)
    parser.add_argument("--only", default="",
                        help="run only entries whose name contains one of these comma-separated substrings")
    parser.add_argument("--fast", action="store_true", help="run only the fast subset")
    parser.add_argument("--resume", action="store_true",
                        help="skip models already recorded in --out under the current check")
    parser.add_argument("--out", default="results/zoo.jsonl", help="JSON lines file to append to")
    parser.add_argument("--timeout", type=float, default=120.0, help="World timeout per wait (seconds)")
    parser.add_argument("--table", metavar="JSONL", help="print a Markdown table of JSONL and exit")
    parser.add_argument("--doc", metavar="MD", help="with --table: write it between the zoo-table markers of MD "
                        "(docs/zoo.md)")
    args = parser.parse_args(argv)
    if args.table:
        text = table(args.table)
        if args.doc:
            write_doc(args.doc, text)
        print(text)
        return 0
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
