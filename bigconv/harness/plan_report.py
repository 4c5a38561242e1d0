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
from .cost_model import Cluster, Estimate, Profiler, ProxyMismatch
from .op_table import OpTable
from .plan_search import FIXED, choose, max_size, smallest_count, with_gpus

GiB = 2**30
WHOLE_NODE_STEPS = 8
"""Node counts tried above the fewest GPUs that fit, rounded up to whole nodes, for a grid that fits there too."""
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
              "max_size": None, "max_size_searched": bool(args.max_size), "templates": None, "templates_for": None}
    try:
        best, priced = choose(profiler, shape, cluster, grid=args.grid, replicas=args.replicas)
    except ValueError as exc:
        result["decomposable"] = isinstance(exc, ProxyMismatch)  # it decomposes; the planner cannot price it
        result["refusal"] = {"error": type(exc).__name__, "message": str(exc)}
        return result
    result["plan"] = as_dict(best, cluster)
    result["alternatives"] = [summary(e) for e in priced if e is not best]
    launch = (best, cluster) if best.fits else None
    if not args.no_search:
        n, e = smallest_count(profiler, shape, cluster)
        if n is not None:
            nodes = -(-n // cluster.gpus_per_node)
            whole, w = whole_nodes(profiler, shape, cluster, n, e)
            result["smallest"] = {"gpus": n, "grid": list(e.grid), "nodes": nodes, "total_bytes": e.memory["total"],
                                  "step_s": e.time["step"], "whole_nodes": {
                                      "gpus": whole.gpus, "nodes": whole.nodes, "grid": list(w.grid),
                                      "replicas": w.replicas, "fits": w.fits, "total_bytes": w.memory["total"],
                                      "step_s": w.time["step"], "exposed_comm_fraction": halo_fraction(w)}}
            if launch is None and w.fits:
                launch = (w, whole)
    if args.max_size:
        size, e = max_size(profiler, shape, cluster, multiple=args.size_multiple,
                           grid=args.grid if args.grid else None)
        result["max_size"] = None if size is None else {
            "input": list(size), "grid": list(e.grid), "total_bytes": e.memory["total"], "step_s": e.time["step"]}
    # Launch lines only for a plan that fits: the one asked for, else the whole-node one found; none otherwise.
    result["templates"] = templates(*launch) if launch else None
    result["templates_for"] = None if launch is None else {
        "gpus": launch[1].gpus, "nodes": launch[1].nodes, "grid": list(launch[0].grid), "replicas": launch[0].replicas}
    return result


def whole_nodes(profiler: Profiler, shape: tuple[int, ...], cluster: Cluster, n: int, e: Estimate
                ) -> tuple[Cluster, Estimate]:
    """The fewest GPUs that fit (``n``, its estimate ``e``) in whole nodes: the plan on the next whole-node
    count, or on the first of the ``WHOLE_NODE_STEPS`` counts after it whose plan fits (more GPUs can still
    not fit: another count's balanced grids cut the image into other shapes); the last tried if none does."""
    per = cluster.gpus_per_node
    whole = -(-n // per) * per
    if whole == n:
        return with_gpus(cluster, n), e
    for count in range(whole, whole + per * WHOLE_NODE_STEPS + 1, per):
        c = with_gpus(cluster, count)
        w, _ = choose(profiler, shape, c)
        if w.fits:
            break
    return c, w


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
    if r["plan"] is None:
        why = "Decomposable: NO (found by the dry run)" if not r["decomposable"] else \
            "Decomposable: yes, but this plan cannot be priced"
        return "\n".join(head + [why, "", r["refusal"]["message"]])
    p = r["plan"]
    m, t = p["memory_bytes"], p["time_s"]
    lines = head + [f"Grid {_x(p['grid'])}" + (f" x {p['replicas']} replicas" if p["replicas"] > 1 else "")
                    + f": largest shard {_x(p['shard'])} ("
                    + ("priced on the grid itself" if p["proxy_grid"] == p["grid"] else
                       f"priced on a {_x(p['proxy_grid'])} proxy of the same shards") + ")"]
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
                      f"{_s(s['step_s'])} per step)"]
        if w["fits"]:
            lines.append(f"In whole nodes: {w['gpus']} GPUs on {w['nodes']} node(s), grid {_x(w['grid'])}"
                         + (f" x {w['replicas']} replicas" if w["replicas"] > 1 else "")
                         + f": {_b(w['total_bytes'])} per process (fits), {_s(w['step_s'])} per step, exposed "
                           f"communication {100 * w['exposed_comm_fraction']:.1f}%")
        else:
            lines.append(f"In whole nodes: none of the counts up to {w['gpus']} GPUs ({w['nodes']} nodes) fits (their "
                         f"balanced grids cut other shard shapes than {_x(s['grid'])}); run that grid with "
                         f"--gpus {s['gpus']} --grid {_x(s['grid'])} on partly filled nodes")
    elif "smallest" in r and r["smallest"] is None and not p["fits"]:
        lines += ["", "Fewest GPUs that fit: none up to the search's limit"]
    if r.get("max_size"):
        s = r["max_size"]
        lines += [f"Largest input on {c['gpus']} GPUs: {_x(s['input'])} (grid {_x(s['grid'])}, "
                  f"{_b(s['total_bytes'])} per process, {_s(s['step_s'])} per step)"]
    elif r.get("max_size_searched"):
        fixed = sum(m.get(k, 0) for k in FIXED)
        lines += [f"Largest input on {c['gpus']} GPUs: none fits, down to the smallest input the search tries"
                  + (f": what does not shrink with the image (parameters, optimizer state, the device's reserve: "
                     f"{_b(fixed)}) alone exceeds the {_b(m['budget'])} budget" if fixed > m["budget"] else "")]
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
    if r["templates"] is None:
        lines += ["", "Launch: nothing that fits was found, so no launch lines (more GPUs, a card with more memory, "
                      "--amp bfloat16 or a smaller input; docs/check.md)"]
    else:
        f = r["templates_for"]
        lines += ["", "Launch (docs/clusters.md)" + ("" if f["gpus"] == c["gpus"] else
                  f", for the {f['gpus']}-GPU plan that fits (grid {_x(f['grid'])}"
                  + (f" x {f['replicas']} replicas" if f["replicas"] > 1 else "")
                  + f" on {f['nodes']} node(s)), not the {c['gpus']} GPUs asked for") + ":"]
        lines += [f"  {k}: {v}" for k, v in r["templates"].items()]
    lines += ["", "Every figure is a prediction (docs/check.md says how each is computed and what it leaves out; "
                  "benchmarks/planner.md how far it was from measurements)."]
    return "\n".join(lines)

