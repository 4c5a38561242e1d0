"""``python -m bigconv.check MODEL --input ... --gpus N --gpu NAME``: the cluster planner's answer and report.

``plan(args)`` builds the cluster from the device table (``bigconv.harness.devices``) and the flags, prices
the candidate grids (``plan_search.choose``), searches the fewest GPUs that fit and, with ``--max-size``, the
largest image that fits the count; ``report(result)`` is the terminal text and the result itself the
``--json`` object. Every figure is a prediction of ``bigconv.harness.cost_model``: how each is computed and
what it leaves out is in ``docs/check.md``; how far it was from measurements, in ``benchmarks/planner.md``.
"""

from __future__ import annotations

from dataclasses import asdict

from . import devices
from .cost_model import Cluster, Estimate, Profiler
from .op_table import OpTable
from .plan_search import choose, max_size, smallest_count, with_gpus

GiB = 2**30
MEMORY_PARTS = [("parameters", "parameters"), ("optimizer", "optimizer state"),
                ("autocast_weights", "autocast weight copies"), ("activations", "activations (largest shard)"),
                ("halo_buffers", "halo buffers"), ("gradients", "parameter gradients"),
                ("gradient_buckets", "gradient buckets (flat copies the allreduce sums)"),
                ("input", "input shard"), ("loss", "dense loss (log-probabilities, gradient)"),
                ("reserve", "CUDA context, libraries, NCCL (device table)")]


def cluster_from(args) -> Cluster:
    dev = devices.device(args.gpu)
    if args.memory is not None:
        dev = devices.device(f"{args.gpu}{',' if ':' in args.gpu else ':'}memory_gib={args.memory}")
    intra = devices.link(args.link or dev.intra)
    inter = devices.link(args.inter or dev.inter)
    table = OpTable.load(args.op_table) if args.op_table else None
    return Cluster(device=dev, gpus=args.gpus, nodes=args.nodes, gpus_per_node=args.gpus_per_node, intra=intra,
                   inter=inter, dtype=args.dtype, amp=args.amp, optimizer=args.optimizer, op_table=table,
                   headroom=args.headroom)


def plan(args, model) -> dict:
    shape = tuple(args.input)
    cluster = cluster_from(args)
    profiler = Profiler(model, args.dtype)
    result = {"model": args.model, "input": list(shape), "mode": "plan", "cluster": describe(cluster),
              "decomposable": True, "refusal": None, "plan": None, "alternatives": [], "smallest": None,
              "max_size": None}
    try:
        best, priced = choose(profiler, shape, cluster, grid=args.grid, replicas=args.replicas)
    except ValueError as exc:
        result["decomposable"] = False
        result["refusal"] = {"error": type(exc).__name__, "message": str(exc)}
        return result
    result["plan"] = as_dict(best, cluster)
    result["alternatives"] = [summary(e) for e in priced if e is not best]
    if not args.no_search:
        n, e = smallest_count(profiler, shape, cluster)
        if n is not None:
            nodes = -(-n // cluster.gpus_per_node)
            whole = nodes * cluster.gpus_per_node
            w, _ = choose(profiler, shape, with_gpus(cluster, whole)) if whole != n else (e, None)
            result["smallest"] = {"gpus": n, "grid": list(e.grid), "nodes": nodes, "total_bytes": e.memory["total"],
                                  "step_s": e.time["step"], "whole_nodes": {
                                      "gpus": whole, "grid": list(w.grid), "replicas": w.replicas, "fits": w.fits,
                                      "total_bytes": w.memory["total"], "step_s": w.time["step"],
                                      "exposed_comm_fraction": halo_fraction(w)}}
    if args.max_size:
        size, e = max_size(profiler, shape, cluster, multiple=args.size_multiple,
                           grid=args.grid if args.grid else None)
        result["max_size"] = None if size is None else {
            "input": list(size), "grid": list(e.grid), "total_bytes": e.memory["total"], "step_s": e.time["step"]}
    result["templates"] = templates(best, cluster)
    return result


def describe(c: Cluster) -> dict:
    return {"gpu": c.device.name, "gpus": c.gpus, "nodes": c.nodes, "gpus_per_node": c.per_node, "headroom": c.headroom,
            "memory_bytes": c.device.memory_bytes, "intra": c.intra.name, "inter": c.inter.name if c.nodes > 1 else None,
            "dtype": c.dtype, "amp": c.amp, "optimizer": c.optimizer,
            "rates": "op table" if c.op_table is not None else "device table (roofline)"}


def summary(e: Estimate) -> dict:
    return {"grid": list(e.grid), "replicas": e.replicas, "total_bytes": e.memory["total"], "fits": e.fits,
            "step_s": e.time["step"]}


def as_dict(e: Estimate, cluster: Cluster) -> dict:
    return {"grid": list(e.grid), "replicas": e.replicas, "ranks": cluster.gpus, "shard": list(e.shard),
            "proxy_grid": list(e.proxy_grid), "fits": e.fits, "memory_bytes": dict(e.memory),
            "time_s": dict(e.time), "halo_fraction": halo_fraction(e), "buckets_bytes": list(e.buckets),
            "layers": [asdict(row) for row in e.layers], "notes": list(e.notes)}


def halo_fraction(e: Estimate) -> float:
    """The exchanges' exposed time as a fraction of the step."""
    return e.time["exposed_comm"] / e.time["step"] if e.time["step"] else 0.0


def templates(e: Estimate, c: Cluster) -> dict:
    """The launch commands of ``docs/clusters.md``'s templates for this plan."""
    grid = "x".join(map(str, e.grid))
    args = f"--grid {grid} --replicas {e.replicas}"
    return {
        "slurm": f"sbatch --nodes={c.nodes} --ntasks-per-node={c.per_node} --gpus-per-task=1 "
                 f"experiments/cluster/spmd_slurm.sbatch train.py {args}",
        "lsf": f"RANKS={c.gpus} bsub -nnodes {c.nodes} -W 120 -P PROJECT experiments/cluster/spmd_lsf.sh train.py {args}",
        "torchrun": f"NNODES={c.nodes} NPROC={c.per_node} HEAD=<first node> bash experiments/cluster/spmd_torchrun.sh "
                    f"train.py {args}   # on every node",
    }


# -- the terminal report --------------------------------------------------------------------------------

def _b(n: float) -> str:
    return f"{n / GiB:,.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:,.1f} MiB"


def _s(t: float) -> str:
    return f"{t * 1e6:,.0f} µs" if t < 1e-3 else f"{t * 1e3:,.1f} ms" if t < 1 else f"{t:,.2f} s"


def _x(v) -> str:
    return "x".join(str(i) for i in v)


def report(r: dict, layers: bool = False) -> str:
    c = r["cluster"]
    where = (f"{c['gpus']} x {c['gpu']} ({_b(c['memory_bytes'])} each), {c['nodes']} node(s) of {c['gpus_per_node']}, "
             f"{c['intra']} within a node" + (f", {c['inter']} between nodes" if c["inter"] else ""))
    head = [f"bigconv plan (PREDICTED): {r['model']} on {_x(r['input'])}, {c['dtype']}"
            + (f" with autocast {c['amp']}" if c["amp"] else "") + f", optimizer {c['optimizer']}", where,
            f"rates: {c['rates']}", ""]
    if not r["decomposable"]:
        return "\n".join(head + ["Decomposable: NO (found by the dry run)", "", r["refusal"]["message"]])
    p = r["plan"]
    m, t = p["memory_bytes"], p["time_s"]
    lines = head + [f"Grid {_x(p['grid'])}" + (f" x {p['replicas']} replicas" if p["replicas"] > 1 else "")
                    + f": largest shard {_x(p['shard'])} (priced on a {_x(p['proxy_grid'])} proxy of the same shards)"]
    for alt in r["alternatives"]:
        lines.append(f"  also priced: {_x(alt['grid'])}" + (f" x {alt['replicas']}" if alt["replicas"] > 1 else "")
                     + f": {_b(alt['total_bytes'])}, {_s(alt['step_s'])} per step")
    lines += ["", f"Memory per process, at its peak ({m['peak_at']}):"]
    for key, label in MEMORY_PARTS:
        if m.get(key):
            lines.append(f"  {label:52} {_b(m[key]):>14}")
    verdict = "fits" if p["fits"] else "DOES NOT FIT"
    lines.append(f"  {'total':52} {_b(m['total']):>14}  of {_b(m['budget'])}: {verdict}")
    lines.append(f"  ({_b(m['budget'])} is {_b(m['capacity'])} less {100 * c['headroom']:.0f}% headroom for the "
                 "caching allocator's fragmentation: --headroom)")
    lines += ["", "Time per step (slowest rank):",
              f"  compute: forward {_s(t['forward'])}, backward {_s(t['backward'])}",
              f"  halo exchanges {_s(t['halo'])} and statistics/gathers {_s(t['gather'])} (forward and backward); "
              f"{_s(t['hidden'])} hidden behind compute, {_s(t['exposed_comm'])} exposed",
              f"  gradient allreduce {_s(t['allreduce'])} in {len(p['buckets_bytes'])} bucket(s) "
              f"({_b(sum(p['buckets_bytes']))}), {_s(t['allreduce_exposed'])} after backward ends",
              f"  optimizer {_s(t['optimizer'])}",
              f"  step {_s(t['step'])}; exposed communication {100 * p['halo_fraction']:.1f}% of it"]
    if r["smallest"]:
        s = r["smallest"]
        w = s["whole_nodes"]
        lines += ["", f"Fewest GPUs that fit: {s['gpus']} (grid {_x(s['grid'])}, {_b(s['total_bytes'])} per process, "
                      f"{_s(s['step_s'])} per step)",
                  f"In whole nodes: {w['gpus']} GPUs on {s['nodes']} node(s), grid {_x(w['grid'])}"
                  + (f" x {w['replicas']} replicas" if w["replicas"] > 1 else "")
                  + f": {_b(w['total_bytes'])} per process ({'fits' if w['fits'] else 'DOES NOT FIT'}), "
                    f"{_s(w['step_s'])} per step, exposed communication {100 * w['exposed_comm_fraction']:.1f}%"]
    elif "smallest" in r and r["smallest"] is None and not p["fits"]:
        lines += ["", "Fewest GPUs that fit: none up to the search's limit"]
    if r.get("max_size"):
        s = r["max_size"]
        lines += [f"Largest input on {c['gpus']} GPUs: {_x(s['input'])} (grid {_x(s['grid'])}, "
                  f"{_b(s['total_bytes'])} per process, {_s(s['step_s'])} per step)"]
    for note in p["notes"]:
        lines += ["", f"Note: {note}"]
    if layers:
        lines += ["", f"{'layer':34} {'GFLOP fwd':>10} {'fwd':>9} {'bwd':>9} {'msgs':>5} {'sent':>10} {'comm':>9} "
                      f"{'hidden':>9}"]
        for row in p["layers"]:
            lines.append(f"{row['module'][:34]:34} {row['flops'] / 1e9:>10.2f} {_s(row['forward_s']):>9} "
                         f"{_s(row['backward_s']):>9} {row['messages']:>5} {_b(row['sent_bytes']):>10} "
                         f"{_s(row['comm_s']):>9} {_s(row['hidden_s']):>9}")
        lines.append("(msgs, sent: this rank's forward messages and bytes, as many again in backward; comm: forward and "
                     "backward)")
    lines += ["", "Launch (docs/clusters.md):"] + [f"  {k}: {v}" for k, v in r["templates"].items()]
    lines += ["", "Every figure is a prediction (docs/check.md says how each is computed and what it leaves out; "
                  "benchmarks/planner.md how far it was from measurements)."]
    return "\n".join(lines)

