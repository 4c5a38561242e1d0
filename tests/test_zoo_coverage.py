"""``experiments.zoo_coverage --table``: the zoo table shows each model's verdict under the current check
and keeps every earlier record visible, mismatches named and dated (nothing is dropped by taking only the
last record). A failure points at experiments/zoo_coverage.py.
"""

from __future__ import annotations

import json

from experiments import zoo_coverage as zc

ERRORS = {"forward": 1e-15, "input_grad": 2e-15, "param_grads": 3e-15, "loss": 0.0, "weights": 4e-15}


def record(name: str, status: str, metric: str | None, when: str, **errors) -> dict:
    rec = {"name": name, "library": name.split("/")[0], "status": status, "expect": "exact",
           "as_expected": status == "exact", "time": when,
           "errors": {**ERRORS, **errors, "replicas_equal": True, "keys_match": True, "tol": 1e-9}}
    if metric:
        rec["metric"] = metric
        rec["worst"] = {k: {"tensor": f"{k}.t", "rel": v, "error": v, "scale": 1.0, "noise": 0.0}
                        for k, v in rec["errors"].items() if k in ERRORS}
    return rec


def test_table_shows_current_verdicts_and_every_earlier_mismatch(tmp_path):
    path = tmp_path / "zoo.jsonl"
    recs = [record("timm/a", "mismatch", None, "2026-11-20T10:00:00", loss=1.0e-8),
            record("timm/a", "exact", None, "2026-11-21T10:00:00"),
            record("timm/a", "exact", zc.METRIC, "2026-11-24T10:00:00"),
            record("timm/b", "exact", None, "2026-11-21T10:00:00"),
            record("timm/c", "mismatch", zc.METRIC, "2026-11-24T11:00:00", weights=2e-6),
            {**record("timm/d", "ill-conditioned", zc.METRIC, "2026-11-26T11:00:00"), "shape": [2, 3, 64, 64],
             "ill_conditioned_count": 3, "as_expected": True,
             "rerun": {"shape": [2, 3, 128, 128], "status": "exact"}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    text = zc.table(str(path))
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| timm/")}
    assert "| verdict | exact |" in rows["timm/a"]
    assert "mismatch 2026-11-20 (old check): loss 1.0e-08" in rows["timm/a"]  # the earlier mismatch stays visible
    assert "old check: exact x1" in rows["timm/a"]
    assert "| old check | exact |" in rows["timm/b"]  # not yet re-measured: shown under the check that judged it
    assert "| verdict | mismatch (expected exact) |" in rows["timm/c"] and "weights 2.0e-06 (weights.t)" in rows["timm/c"]
    # Ill-conditioned at its size, exact where conditioned_size sent it: a class of its own, never "exact".
    assert "| verdict | ill-conditioned |" in rows["timm/d"]
    assert "3 tensors ill-conditioned at 2x3x64x64; at 2x3x128x128: exact" in rows["timm/d"]
    assert "1 of 3 models recorded exact, 1 ill-conditioned at their size (1 of them exact when rerun" in text
    assert "1 models not yet recorded under it" in text
    assert "1 earlier records were not exact" in text


def test_doc_block_is_replaced_between_markers(tmp_path):
    doc = tmp_path / "zoo.md"
    doc.write_text(f"intro\n{zc.DOC_START}\nold table\n{zc.DOC_END}\nafter\n")
    zc.write_doc(str(doc), "new table")
    assert doc.read_text() == f"intro\n{zc.DOC_START}\nnew table\n{zc.DOC_END}\nafter\n"
