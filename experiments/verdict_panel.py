"""The sabotage panel: errors planted in the distributed run of models that are known traps for an
exactness check, and what the verdict says of each (``bigconv.sabotage``). Every sabotage must read
``not exact``; every clean run ``exact``, or ``ill-conditioned at this size`` and ``exact`` again at the
size ``bigconv.verify.conditioned_size`` names.

    python -m experiments.verdict_panel                       # -> results/verdict_panel.jsonl, a table
    python -m experiments.verdict_panel --old 781082b         # also the verdict of that commit's verify.py
    python -m experiments.verdict_panel --only tinynet

``--old`` loads ``bigconv/verify.py`` as it was at a commit and asks its verdict about the same runs
(the same sabotaged distributed results, its own single-process reference and noise floors), so the
table shows which planted errors an earlier check let through.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bigconv.compat import allow_torchvision_without_ops

allow_torchvision_without_ops()  # before timm and smp

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from bigconv.engine.dry_run import copy_model  # noqa: E402
from bigconv.harness import cli  # noqa: E402
from bigconv.provenance import source_commit  # noqa: E402
from bigconv.sabotage import OTHER_SEED, SABOTAGES, panel_runs, run_panel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def panel_models() -> dict:
    """name -> (build, (x, y), workers, grid): the traps the issue names and a plain CNN."""
    sys.path.insert(0, str(ROOT / "tests"))
    from zoo import BY_NAME

    from bigconv.models import CNN2D

    def zoo(name):
        e = BY_NAME[name]
        return e.build, e.inputs(torch.Generator().manual_seed(1)), e.workers, e.grid

    def fpn():
        import segmentation_models_pytorch as smp
        return smp.FPN(encoder_name="tu-mobileone_s0", encoder_weights=None, classes=3)

    g = torch.Generator().manual_seed(1)
    fpn_inputs = (torch.randn(2, 3, 64, 64, generator=g, dtype=torch.float64), torch.randint(0, 3, (2, 64, 64),
                                                                                             generator=g))
    g = torch.Generator().manual_seed(1)
    cnn_inputs = (torch.randn(2, 3, 32, 32, generator=g, dtype=torch.float64), torch.randint(0, 3, (2,), generator=g))
    return {
        "bigconv/CNN2D": (lambda: CNN2D(3, 3), cnn_inputs, 4, (2, 2)),
        "timm/tinynet_e_droppath": zoo("timm/tinynet_e_droppath"),
        "timm/convnext_atto_droppath": zoo("timm/convnext_atto_droppath"),
        "timm/regnetx_002": zoo("timm/regnetx_002"),
        "timm/gernet_s": zoo("timm/gernet_s"),
        "smp/FPN_mobileone_s0": (fpn, fpn_inputs, 2, (2, 1)),
    }


def load_old(commit: str):
    """``bigconv/verify.py`` at ``commit``, importable beside today's package (relative imports resolve)."""
    text = subprocess.run(["git", "show", f"{commit}:bigconv/verify.py"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "verify_old.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("bigconv.verify_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def old_verdicts(old, model, x, y, loss_fn, tol, runs: dict) -> dict:
    """``old``'s exact/not-exact on each run of ``runs`` (name -> Run), with its own reference and noise."""
    ref = old.train_single(copy_model(model), x, y, loss_fn, 2, torch.optim.SGD, None, 0)
    noise = old.measure_noise(model, x, y, loss_fn, ref, 2, torch.optim.SGD, None, seed=0)
    return {name: None if run is None else ("exact" if old.summarize(old.judge(run, ref, noise, tol), tol)["exact"]
                                            else "not exact") for name, run in runs.items()}


def measure(name: str, build, inputs, workers: int, grid, world, old=None) -> dict:
    """``bigconv.sabotage.run_panel`` on one model, and ``old``'s verdicts on the same runs."""
    torch.manual_seed(0)
    model = build().double()
    x, y = inputs
    loss_fn = nn.CrossEntropyLoss()
    tol = 1e-9
    t0 = time.perf_counter()
    runs = panel_runs(model, world, x, y, loss_fn, grid, tol)
    record = {**run_panel(name, model, world, x, y, loss_fn, grid, tol, runs), "workers": workers}
    if old is not None:
        got, ref = runs.got, runs.ref
        planted = {"clean": got, **{s: plant(got, ref, tol) for s, plant in SABOTAGES.items()}, OTHER_SEED: runs.other}
        record["old"] = old_verdicts(old, model, x, y, loss_fn, tol, planted)
    record["seconds"] = round(time.perf_counter() - t0, 1)
    return record


def table(records: list[dict]) -> str:
    names = [*SABOTAGES, OTHER_SEED]
    head = "| model | clean | " + " | ".join(names) + " |"
    lines = [head, "|" + "---|" * (len(names) + 2)]
    for r in records:
        def cell(key, verdicts):
            v = verdicts.get(key)
            return "n/a" if v is None else v
        clean = r["clean"] + (f" (at {'x'.join(map(str, r['rerun']['shape']))}: {r['rerun']['clean']})"
                              if r.get("rerun") and r["rerun"]["shape"] else "")
        lines.append(f"| {r['model']} | {clean} | " + " | ".join(cell(n, r["sabotaged"]) for n in names) + " |")
        if "old" in r:
            lines.append(f"| (old {r['old_commit']}) | {r['old']['clean']} | "
                         + " | ".join(cell(n, r["old"]) for n in names) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import bigconv

    p = cli.parser("experiments.verdict_panel", __doc__)
    p.add_argument("--old", default=None, help="also the verdict of bigconv/verify.py at this commit")
    p.add_argument("--only", default=None, help="models whose name contains this")
    p.add_argument("--out", default="results/verdict_panel.jsonl", help="JSON lines file to append the records to")
    args = p.parse_args(argv)
    old = load_old(args.old) if args.old else None
    commit, dirty = source_commit(str(ROOT))  # the code this process loaded, not the tree when a record is written
    models = {n: m for n, m in panel_models().items() if not args.only or args.only in n}
    records = []
    for workers in sorted({m[2] for m in models.values()}):
        with bigconv.World(workers=workers) as world:
            for name, (build, inputs, w, grid) in models.items():
                if w != workers:
                    continue
                r = measure(name, build, inputs, w, grid, world, old)
                r.update({"old_commit": args.old, "commit": commit, "dirty": dirty, "torch": torch.__version__,
                          "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
                records.append(r)
                with open(args.out, "a") as fh:
                    fh.write(json.dumps(r) + "\n")
                print(f"{name}: clean {r['clean']}; {r['sabotaged']}" + (f"; old {r['old']}" if old else ""),
                      flush=True)
    print(table(records))
    let_through = [(r["model"], s) for r in records for s, v in r["sabotaged"].items() if v not in (None, "not exact")]
    return 1 if let_through else 0


if __name__ == "__main__":
    sys.exit(main())
