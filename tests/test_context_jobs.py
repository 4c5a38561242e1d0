"""The context sweep's ``--jobs``: runs side by side in fresh processes must record what one at a time records.

Every run seeds its own weights and data, so the records of ``--jobs 2`` (the whole-image run on its own
World in a child process, the tile run beside it) must equal those of the sequential sweep field by field,
times and dates aside, and a rerun must skip them. A run that fails in its child is named with its output,
recorded nowhere, and the others are still recorded. A failure here points to ``experiments/context_jobs.py``
or ``experiments.context._Runner``.
"""

from __future__ import annotations

import json
import time

import pytest

from experiments import context
from experiments.context_jobs import Job, RunFailed, run_jobs

ARGS = ["--quick", "--methods", "whole,mil", "--dials", "0.5", "--steps", "3", "--test-images", "8",
        "--tasks", "order", "--lrs", "0.001,0.01"]
VARYING = {"train_s", "time", "env"}


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.own_world
@pytest.mark.timeout(300)
def test_jobs_record_what_one_at_a_time_records(tmp_path, exclusive):
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    context.main(ARGS + ["--out", str(one), "--figure", str(tmp_path / "f1")])
    context.main(ARGS + ["--out", str(two), "--figure", str(tmp_path / "f2"), "--jobs", "2"])

    def runs(path):
        return {context._record_key(r): {k: v for k, v in r.items() if k not in VARYING}
                for r in _lines(path) if r["record"] == "run"}

    def selections(path):
        return sorted((json.dumps({k: v for k, v in r.items() if k != "time"}, sort_keys=True)
                       for r in _lines(path) if r["record"] == "selection"))

    a, b = runs(one), runs(two)
    # 2 methods x (2 trials + 1 test run) at one dial and one seed
    assert len(a) == 6 and a.keys() == b.keys()
    for key in a:
        assert a[key] == b[key], key
    assert len(selections(one)) == 2 and selections(one) == selections(two)
    assert all(r["train_s"] > 0 for r in _lines(two) if r["record"] == "run")
    before = len(_lines(two))
    context.main(ARGS + ["--out", str(two), "--figure", str(tmp_path / "f2"), "--jobs", "2"])
    assert len(_lines(two)) == before  # everything recorded: nothing runs


@pytest.mark.timeout(120)
def test_a_failing_run_is_named_and_the_others_recorded(tmp_path):
    s = context.quick_setting(methods=("mil",), dials=(0.5,), steps=2, test_images=4)
    spec = {"setting": context._setting_fields(s), "task": "order", "dial": 0.5, "seed": 0, "lr": 1e-3,
            "split": "test"}
    done = []
    jobs = [Job({**spec, "method": "mil"}, 1, "good run"), Job({**spec, "method": "nonsense"}, 1, "bad run"),
            Job({**spec, "method": "mil", "seed": 1}, 1, "second good run")]
    with pytest.raises(RunFailed, match=r"1 run\(s\) failed(.|\n)*bad run \(exit status 1\)(.|\n)*nonsense"):
        run_jobs(jobs, 2, lambda job, r, t: done.append(job.label), echo=lambda m: None)
    assert sorted(done) == ["good run", "second good run"]
    with pytest.raises(ValueError, match="jobs must be a positive integer"):
        run_jobs(jobs, 0, lambda *a: None)


@pytest.mark.timeout(120)
def test_a_run_past_its_timeout_is_stopped_and_named(tmp_path):
    s = context.quick_setting(methods=("mil",), dials=(0.5,), steps=2000, test_images=4)
    spec = {"setting": context._setting_fields(s), "task": "order", "dial": 0.5, "seed": 0, "lr": 1e-3,
            "split": "test", "method": "mil"}
    t0 = time.perf_counter()
    with pytest.raises(RunFailed, match=r"slow run \(still running after its 3 s, stopped with its workers\)"):
        run_jobs([Job(spec, 1, "slow run")], 1, lambda *a: None, echo=lambda m: None, timeout=3)
    assert time.perf_counter() - t0 < 60


@pytest.mark.timeout(180)
def test_a_run_past_its_cpu_limit_is_stopped_and_a_sleeping_one_is_not(monkeypatch):
    """The tissue sweep bounds a run by the CPU its process tree used, not by wall time (a paused or starved
    sweep's runs take long without being stuck): a busy child past the limit is stopped and named, a child that
    sleeps longer than the limit in wall time finishes."""
    from experiments import context_jobs

    monkeypatch.setattr(context_jobs, "CPU_POLL", 0.5)
    busy = "import sys\nsys.stdin.read()\nwhile True: pass\n"
    done = []
    with pytest.raises(RunFailed, match=r"busy run \(used more than its 1.5 CPU seconds, stopped with its workers\)"):
        run_jobs([Job({}, 1, "busy run")], 1, lambda *a: None, echo=lambda m: None, child=busy, cpu_timeout=1.5)
    sleepy = "import sys, time\nsys.stdin.read()\ntime.sleep(3)\nprint('context-run-result: {}')\n"
    run_jobs([Job({}, 1, "sleepy run")], 1, lambda job, r, t: done.append(t), echo=lambda m: None, child=sleepy,
             cpu_timeout=1.5)
    assert len(done) == 1 and done[0] >= 3
