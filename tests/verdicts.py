"""What an equivalence test asserts of ``bigconv.verify.compare_training``'s result: the verdict and the raw
errors behind it, so that no test rests on the verdict's own bookkeeping alone."""

from __future__ import annotations

from bigconv.verify import ERROR_KEYS, NOISE_FACTOR, RESIDUE_NOISE

TOL = 1e-9


def assert_exact(r: dict, tol: float = TOL) -> None:
    """``exact``: no tensor ill-conditioned; every tensor but the residues within ``tol`` of its own size
    (raw: error over size); each residue without a significant digit and within ``NOISE_FACTOR`` times its
    noise; replicas equal and the plain model's keys."""
    assert r["verdict"] == "exact", (r["verdict"], list(r["wrong"])[:3], list(r["ill_conditioned"])[:3])
    assert not r["ill_conditioned"] and not r["wrong"]
    raw = {(t["category"], t["tensor"]): t["rel"] for t in r["tensors"] if t["status"] != "residue" and t["rel"] > tol}
    assert not raw, raw
    for t in r["residues"]:
        assert t["category"] in ("param_grads", "weights"), t
        assert t["noise"] >= RESIDUE_NOISE * t["scale"] and t["error"] <= NOISE_FACTOR * t["noise"], t
    assert all(r[k] <= tol for k in ERROR_KEYS), {k: (r[k], r["worst"][k]) for k in ERROR_KEYS if not r[k] <= tol}
    assert r["keys_match"], "the state dict's keys differ from the plain model's"
    assert r["replicas_equal"], "replicas drifted apart: the gradient allreduce or optimizer differs per worker"
