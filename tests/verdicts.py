"""What an equivalence test asserts of ``bigconv.verify.compare_training``'s result: the verdict and the raw
errors behind it, so that no test rests on the verdict's own bookkeeping alone."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from bigconv.verify import ERROR_KEYS, NOISE_FACTOR, RESIDUE_NOISE, compare_training

TOL = 1e-9


def verdict(model, world, x, y, loss=None, grid=(2, 2)) -> dict:
    """``compare_training`` on ``world`` (cross-entropy unless ``loss``), its warnings silenced, without the
    parallel model it returns."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = compare_training(model, world, x, y, loss or nn.CrossEntropyLoss(), grid=grid)
    r.pop("net", None)
    return r


def assert_exact(r: dict, tol: float = TOL) -> None:
    """``exact``: no tensor ill-conditioned; every tensor but the residues within ``tol`` of its own size
    (raw: error over size); each residue a parameter gradient, weight or optimizer state that the noise runs
    leave without a significant digit, at most ``tol`` of the largest of its kind, within ``NOISE_FACTOR`` times
    the larger of its noise and its own size (no other floor); every worker's copy equal; the plain model's keys."""
    assert r["verdict"] == "exact", (r["verdict"], list(r["wrong"])[:3], list(r["ill_conditioned"])[:3])
    assert not r["ill_conditioned"] and not r["wrong"]
    raw = {(t["category"], t["tensor"]): t["rel"] for t in r["tensors"] if t["status"] != "residue" and t["rel"] > tol}
    assert not raw, raw
    largest = {}
    for t in r["tensors"]:
        largest[t["category"]] = max(largest.get(t["category"], 0.0), t["scale"])
    for t in r["residues"]:
        assert t["category"] in ("param_grads", "weights", "optimizer"), t
        assert t["noise"] >= RESIDUE_NOISE * t["scale"] and t["error"] <= NOISE_FACTOR * max(t["noise"], t["scale"]), t
        assert t["scale"] <= tol * largest[t["category"]], t
    assert all(r[k] <= tol for k in ERROR_KEYS), {k: (r[k], r["worst"][k]) for k in ERROR_KEYS if not r[k] <= tol}
    assert r["keys_match"], "the state dict's keys differ from the plain model's"
    assert r["replicas_equal"], ("workers' copies drifted apart (the gradient allreduce or optimizer differs per "
                                 f"worker): {list(r.get('replicas_disagree', []))[:3]}")
