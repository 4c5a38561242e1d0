"""The one-device alternatives table: its quick run's records, its exactness column and its refusals.

``python -m experiments.alternatives --quick`` must measure every quick row in fresh processes and
write one record per row with the documented fields in their units (bytes, seconds, pixels), search
each row's largest edge within the quick budget (the quick search stops at its first probe, the
fixed-size run: it checks the plumbing into ``experiments.maxsize``, not an answer), and find the bigconv rows (driver, SPMD, checkpointed)
equal to plain PyTorch after 2 steps in float64: their ``rel_err`` is at float64 rounding (<= 1e-12:
2 steps of a 3-layer CNN sum a few hundred terms per weight, in another order than one process).
Sizes that cannot be laid out are refused with a ValueError naming the limit before anything runs.
A failure points to ``experiments/alternatives.py`` or ``plots/alternatives.py``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from experiments import alternatives as alt

MiB = 2**20


@pytest.mark.parametrize("kw, text", [
    (dict(size=128, tile=256), "larger than the image"),
    (dict(size=128, tile=8), "must exceed 12"),
    (dict(size=128, tile=64, check_size=16), "at least 26"),
    (dict(size=0, tile=64), "positive integer"),
])
def test_sizes_that_cannot_be_laid_out_are_refused(kw, text):
    args = {**dict(size=128, tile=64, check_size=32, depth=3, budget=64 * MiB), **kw}
    with pytest.raises(ValueError, match=text):
        alt.check_sizes(**args)


def test_the_cli_refuses_before_running(tmp_path):
    out = tmp_path / "a.jsonl"
    with pytest.raises(ValueError, match="larger than the image"):
        alt.main(["--quick", "--tile", "512", "--out", str(out), "--probes", str(tmp_path / "p.jsonl")])
    assert not out.exists()


def test_a_config_names_its_method():
    with pytest.raises(ValueError, match="method must be one of"):
        alt.AltConfig(method="magic")
    with pytest.raises(ValueError, match="workers must be 0"):
        alt.AltConfig(method="plain", workers=2)
    with pytest.raises(ValueError, match="tile"):
        alt.AltConfig(method="streaming")


def test_rel_err_is_the_worst_tensor():
    ref = [torch.ones(4), torch.full((2,), 2.0)]
    assert alt.rel_err([t.clone() for t in ref], ref) == 0.0
    assert alt.rel_err([ref[0] * 1.5, ref[1]], ref) == pytest.approx(0.5)


@pytest.mark.timeout(420)
def test_quick_run_records_every_row(tmp_path):
    out, probes, fig = tmp_path / "alt.jsonl", tmp_path / "probes.jsonl", tmp_path / "fig"
    alt.main(["--quick", "--out", str(out), "--probes", str(probes), "--figure", str(fig)])
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    plan = alt.quick_plan()
    assert [(r["method"], r["processes"]) for r in recs] == list(plan.rows)
    assert {r["method"] for r in recs} == set(alt.METHODS)
    for r in recs:
        assert r["status"] == "ok", r["message"]
        for key in ("method", "processes", "size", "peak_bytes", "step_s", "max_edge_1gib", "rel_err", "commit"):
            assert key in r, key
        assert r["size"] == plan.size
        assert isinstance(r["peak_bytes"], int) and MiB < r["peak_bytes"] < 2**30  # bytes, not KiB or MiB
        assert 0 < r["step_s"] < 60  # seconds
        assert r["max_edge_1gib"] is None  # the quick budget is not 1 GiB
        assert r["max_edge_budget_bytes"] == plan.budget
        assert r["max_edge_budget"] == plan.size  # one probe: the fixed size, which fits 64 MiB
        assert r["rel_err_dtype"] == "float64" and r["rel_err_size"] == plan.check_size
    by = {r["method"]: r for r in recs}
    assert by["plain"]["rel_err"] == 0.0
    for m in ("bigconv_driver", "bigconv_spmd", "bigconv_checkpoint"):
        assert by[m]["exact_claimed"] and by[m]["rel_err"] <= 1e-12, (m, by[m]["rel_err"])
        assert by[m]["grid"] == [2, 2]
    # the single-process rewrites compute plain's gradients too (streaming on 2x2 tiles)
    for m in ("checkpoint", "offload", "streaming"):
        assert by[m]["rel_err"] <= 1e-12, (m, by[m]["rel_err"])
    searches = [json.loads(line) for line in probes.read_text().splitlines()]
    assert sum(s.get("kind") == "maxsize" for s in searches) == len(plan.rows)
    assert os.path.exists(f"{fig}.png") and os.path.exists(f"{fig}.pdf")
