"""``python -m multidsn.train`` as a fresh clone meets it: the README's commands retrain into a file of their
own (never the committed records), ``--report`` alone reads the committed records, ``--quick`` is a short
smoke run, and a rerun resumes. A failure points at multidsn/train.py or paper_cli.py.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from multidsn import mnist, train
from multidsn.data import Domain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_domains(n: int = 64, size: int = 32) -> tuple[Domain, list[Domain]]:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 3, size, size, generator=g) * 2 - 1
    y = torch.arange(n) % 10
    return Domain("s", x, y, x, y), [Domain("t", -x, y, -x, y, test_light=torch.arange(n) % 3 == 0)]


def test_training_never_writes_the_committed_records_by_default():
    for recipe in ("paper", "demo"):
        args = train.parse_args(["--recipe", recipe])
        assert args.out.startswith("runs/") and args.out != train.COMMITTED[recipe]
        assert not args.out.startswith("results/")
        quick = train.parse_args(["--recipe", recipe, "--quick"])
        assert quick.out.startswith("runs/") and quick.out.endswith("_quick.jsonl")


def test_report_alone_reads_the_committed_records_and_out_wins():
    assert train.parse_args(["--report"]).out == "results/multidsn_paper.jsonl"
    assert train.parse_args(["--report", "--out", "x.jsonl"]).out == "x.jsonl"
    assert train.parse_args(["--recipe", "demo", "--report"]).out == "results/multidsn_train.jsonl"


def test_quick_is_short_and_given_options_win():
    q = train.parse_args(["--quick"])
    assert (q.steps, q.warmup, q.lr_decay_steps, q.seeds) == (300, 100, 100, [0])
    assert train.parse_args([]).lr_decay_steps == 1000  # the full recipe keeps the paper's schedule
    q = train.parse_args(["--quick", "--steps", "50", "--warmup", "10", "--seeds", "3", "--out", "o.jsonl"])
    assert (q.steps, q.warmup, q.seeds, q.out) == (50, 10, [3], "o.jsonl")


@pytest.mark.timeout(120)
def test_the_readme_report_prints_the_committed_table_and_touches_nothing(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = os.path.join(ROOT, "results", "multidsn_paper.jsonl")
    before = hashlib.sha256(open(path, "rb").read()).hexdigest()
    monkeypatch.setattr("multidsn.paper_cli.paper_domains", lambda *a, **k: pytest.fail("--report loaded data"))
    train.main(["--report"])
    assert hashlib.sha256(open(path, "rb").read()).hexdigest() == before
    out = capsys.readouterr().out
    assert "| source_only | 0,1,2 |" in out and "| dsn_dann | 0,1,2 |" in out


@pytest.mark.timeout(120)
def test_a_fresh_run_trains_into_runs_and_a_rerun_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source, targets = small_domains()
    monkeypatch.setattr(mnist, "paper_domains", lambda extra=None, size=32: (source, targets))
    monkeypatch.setattr("multidsn.paper_cli.paper_domains", lambda extra=None: (source, targets))
    argv = ["--steps", "3", "--warmup", "1", "--batch-size", "4", "--seeds", "0", "--methods", "source_only,dann", "-q"]
    train.main(argv)
    out = tmp_path / "runs" / "multidsn_paper.jsonl"
    assert sorted(json.loads(line)["method"] for line in out.read_text().splitlines()) == ["dann", "source_only"]
    assert not (tmp_path / "results").exists()
    out.write_text(out.read_text().splitlines()[0] + "\n")  # as if stopped after the first model
    train.main(argv)
    assert sorted(json.loads(line)["method"] for line in out.read_text().splitlines()) == ["dann", "source_only"]


def test_intervals_match_student_t_and_pair_by_seed():
    from multidsn.intervals import interval, paired

    scipy_stats = pytest.importorskip("scipy.stats")
    for n in (2, 3, 5, 12, 30):
        assert interval([0.0] * (n - 1) + [1.0]).half == pytest.approx(
            scipy_stats.t.ppf(0.975, n - 1) * ((1 / n - 1 / n**2) * n / (n - 1)) ** 0.5 / n**0.5, rel=1e-3)
    d = paired({0: 0.9, 1: 0.8, 2: 0.7}, {0: 0.5, 1: 0.5, 2: 0.4, 3: 0.0})  # seed 3 has no partner
    assert d.n == 3 and d.mean == pytest.approx(1 / 3) and d.excludes(0)
    assert interval([0.5]).low is None and not interval([0.5]).excludes(0)


def test_the_report_says_what_the_numbers_support_never_a_bare_met():
    from multidsn.paper_verdict import verdict

    acc = {"source_only": {0: 0.665, 1: 0.660, 2: 0.670}, "dann": {0: 0.812, 1: 0.820, 2: 0.819},
           "dsn_dann": {0: 0.811, 1: 0.820, 2: 0.825}}
    text = "\n".join(verdict(acc, None))
    assert "MET" not in text and "met by the mean only" in text or "supported: the gain" in text
    assert "not supported: DSN-DANN beating DANN" in text and "not chosen on a validation split" in text
    acc["dsn_dann"] = {0: 0.851, 1: 0.862, 2: 0.859}
    text = "\n".join(verdict(acc, "val"))
    assert "supported: DSN-DANN beats DANN alone" in text and "caution" not in text
    assert "supported: the gain over source-only is at least 15" in text


def test_a_diverged_run_reads_diverged_not_a_result():
    """A run whose training loss ended nan scores chance; the table says "diverged" where its accuracy would be
    and leaves it out of the means and the verdict (issue 53 item 12: `--quick` showed dsn_dann at 10.0%)."""
    from multidsn.paper_cli import table

    def line(method, seed, acc, loss):
        return {"method": method, "target": "mnistm", "seed": seed, "target_acc": acc, "source_acc": 0.9,
                "train_s": 1.0, "history": [{"step": 0, "loss": 2.3}, {"step": 9, "loss": loss}]}

    lines = [line("source_only", 0, 0.55, 0.1), line("dann", 0, 0.6, 0.2), line("dsn_dann", 0, 0.1, float("nan")),
             line("dann", 1, 0.1, float("inf")), line("dann", 2, 0.62, 0.2)]
    text = table(lines, [0, 1, 2])
    assert "| dsn_dann | 0 | diverged |" in text and "10.0" not in text, text
    assert "| dann | 0,2 (1 diverged) | 61.0 ± 1.4 |" in text, text
    assert "| dsn_dann | diverged |" in text and "| dann | 60.0 | diverged | 62.0 |" in text, text
    assert "diverged (training loss not finite at the end" in text and "dann seed 1, dsn_dann seed 0" in text
    assert "dsn_dann - source_only" not in text  # no verdict from a diverged row
