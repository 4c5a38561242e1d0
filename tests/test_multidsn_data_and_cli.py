"""multidsn's data, CLI and benchmark entry point: the procedural domains have the promised shapes and
held-out test splits, image folders load with labels from class folders, ``python -m multidsn.train``
writes its JSON lines, and ``multidsn.bench.run_steps`` runs in one process and on a World.

A failure points at multidsn/data.py, shifts.py, train.py or bench.py.
"""

import json

import numpy as np
import pytest
import torch

from multidsn import bench, train
from multidsn.data import Sampler, load_folder_domains, procedural_domains, standardize, standardized
from multidsn.shifts import SHIFTS


def test_procedural_domains_shapes_and_splits():
    source, targets = procedural_domains(7, image_size=16, seed=0)
    assert [t.name for t in targets] == list(SHIFTS)
    for d in [source, *targets]:
        assert d.train_x.shape[1:] == (3, 16, 16) and d.train_x.dtype == torch.float32
        assert 0 <= float(d.train_x.min()) and float(d.train_x.max()) <= 1
        assert len(d.train_x) + len(d.test_x) == 1797 and len(d.test_y) == len(d.test_x)
    # every target is really shifted away from the source
    assert all(float((t.train_x - source.train_x).abs().mean()) > 0.05 for t in targets)
    with pytest.raises(ValueError, match="unknown shift"):
        procedural_domains(1, shifts=["fog"])


def test_standardize_removes_brightness_and_contrast_per_image():
    x = 0.2 + 0.5 * torch.rand(3, 3, 8, 8)
    z = standardize(x)
    assert torch.allclose(z.flatten(1).mean(1), torch.zeros(3), atol=1e-5)
    assert torch.allclose(z.flatten(1).std(1, unbiased=False), torch.ones(3), atol=1e-5)
    # a per-image gain and offset is gone; the relations between the channels are kept
    assert torch.allclose(standardize(0.1 + torch.tensor([0.5, 2.0, 1.0])[:, None, None, None] * x), z, atol=1e-4)
    assert torch.isfinite(standardize(torch.zeros(1, 3, 4, 4))).all()  # a blank image is not divided by 0
    source, _ = procedural_domains(1, image_size=16, shifts=["contrast"])
    s = standardized(source)
    assert s.train_y is source.train_y and s.test_x.shape == source.test_x.shape


def test_sampler_gives_checked_batches():
    source, targets = procedural_domains(2, image_size=16)
    b = next(Sampler(source, targets, batch_size=5, seed=1))
    assert b.source[0].shape == (5, 3, 16, 16) and len(b.targets) == 2


def test_image_folders(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for domain, labelled in (("photos", True), ("sketches", False)):
        for c in ("cat", "dog"):
            folder = tmp_path / domain / c if labelled else tmp_path / domain
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(5):
                Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(folder / f"{c}{i}.png")
    source, targets = load_folder_domains(tmp_path, "photos", image_size=12, test_fraction=0.2)
    assert source.train_x.shape == (8, 3, 12, 12) and sorted(set(source.train_y.tolist())) == [0, 1]
    assert [t.name for t in targets] == ["sketches"] and targets[0].train_y is None
    with pytest.raises(ValueError, match="source domain 'nope' is not a folder"):
        load_folder_domains(tmp_path, "nope", image_size=12)


@pytest.mark.timeout(120)
def test_train_cli_single_process(tmp_path):
    out = tmp_path / "train.jsonl"
    summary = train.main(["--recipe", "demo", "--targets", "1", "--placement", "single", "--steps", "4", "--warmup", "2",
                          "--image-size", "16", "--width", "4", "--batch-size", "4", "--log-every", "2",
                          "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("model", r.get("record")) for r in lines] == ["dsn", "source_only", "summary"]
    assert set(lines[0]["target_accuracy"]) == {"mnistm"}
    assert summary["gain"] == pytest.approx(lines[0]["mean_target_accuracy"] - lines[1]["mean_target_accuracy"])
    assert isinstance(summary["private_codes_collapsed"], bool) and summary["torch"] == torch.__version__
    assert summary["normalize"] == "image" and summary["config"]["similarity"] == "mmd"


@pytest.mark.timeout(120)
def test_train_cli_several_seeds_reports_the_spread_of_the_gain(tmp_path, capsys):
    out = tmp_path / "train.jsonl"
    summary = train.main(["--recipe", "demo", "--targets", "1", "--shifts", "noise", "--placement", "single", "--steps", "3",
                          "--warmup", "1", "--image-size", "16", "--width", "4", "--batch-size", "4",
                          "--seeds", "3-5", "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r.get("model", r.get("record")), r.get("seed")) for r in lines] == [
        ("dsn", 3), ("source_only", 3), ("dsn", 4), ("source_only", 4), ("dsn", 5), ("source_only", 5),
        ("summary", None)]
    gains = [d["mean_target_accuracy"] - b["mean_target_accuracy"] for d, b in zip(lines[0:6:2], lines[1:6:2])]
    assert summary["seeds"] == [3, 4, 5] and [p["gain"] for p in summary["per_seed"]] == pytest.approx(gains)
    assert summary["gain"] == pytest.approx(np.mean(gains))
    assert summary["gain_std"] == pytest.approx(np.std(gains, ddof=1))
    assert summary["gain_min"] == pytest.approx(min(gains))
    noise = [r["target_accuracy"]["noise"] for r in lines[0:6:2]]
    assert summary["per_target"]["noise"]["dsn"]["mean"] == pytest.approx(np.mean(noise))
    # the seeds really differ: weights, batches and the test split all follow the seed
    assert len({json.dumps(r["history"]) for r in lines[0:6:2]}) == 3
    printed = capsys.readouterr().out
    assert "seed 3" in printed and "seed 5" in printed and "±" in printed


@pytest.mark.parametrize("bad", ["a,b", "2,2", "5-3"])
def test_train_cli_rejects_bad_seed_lists(bad):
    with pytest.raises(SystemExit):
        train.parse_args(["--recipe", "demo", "--seeds", bad])


@pytest.mark.timeout(120)
def test_train_cli_picks_targets_by_name(tmp_path):
    out = tmp_path / "train.jsonl"
    summary = train.main(["--recipe", "demo", "--targets", "2", "--shifts", "noise,invert", "--placement", "single", "--steps", "2",
                          "--warmup", "1", "--image-size", "16", "--width", "4", "--batch-size", "4",
                          "--similarity", "dann", "--skip-baseline", "--out", str(out)])
    assert summary["target_names"] == ["noise", "invert"] and summary["source_only_mean_target_accuracy"] is None


def test_bench_single_process():
    r = bench.run_steps(16, 2, steps=2, width=4, depth=2)
    assert len(r["step_s"]) == 2 and r["workers"] == [] and np.isfinite(r["loss"])


@pytest.mark.world(3)
@pytest.mark.timeout(120)
def test_bench_distributed_matches_single(world):
    one = bench.run_steps(16, 1, steps=2, width=4, depth=2, dtype=torch.float64)
    many = bench.run_steps(16, 1, steps=2, width=4, depth=2, dtype=torch.float64, placement="domain", world=world)
    assert many["workers"] == [0, 1, 2]
    assert many["loss"] == pytest.approx(one["loss"], rel=1e-9)


@pytest.mark.timeout(120)
def test_target_only_bound_trains_on_the_targets_labels(tmp_path):
    from experiments import dsn_target_only

    out = tmp_path / "bound.jsonl"
    records = dsn_target_only.main(["--shifts", "noise,invert", "--steps", "150", "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["shift"] for r in lines] == ["noise", "invert"] and lines == json.loads(json.dumps(records))
    # inverted digits are unreadable to a model of the source (about 10%); one trained on their labels reads them
    assert lines[1]["target_accuracy"] > 0.3


@pytest.mark.timeout(240)
def test_train_killed_and_resumed_writes_what_an_uninterrupted_run_writes(tmp_path):
    """kill -9 in seed 1's DSN, then --resume: seed 0's lines are kept and not written again, seed 1
    restarts from its last checkpoint, and every line equals the uninterrupted run's."""
    import json
    import signal
    import subprocess
    import sys
    import time

    args = [sys.executable, "-m", "multidsn.train", "--recipe", "demo", "--placement", "single", "--steps", "300", "--seeds", "0,1",
            "--batch-size", "8", "--image-size", "16", "--width", "4", "--log-every", "100",
            "--checkpoint-every", "50"]
    subprocess.run(args + ["--out", str(tmp_path / "full.jsonl")], check=True, capture_output=True, timeout=200)
    cut = tmp_path / "cut.jsonl"
    proc = subprocess.Popen(args + ["--out", str(cut)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seed1 = False
    for line in proc.stderr:  # no terminal: a log line every 100 steps, after the checkpoints at 50 and 100
        seed1 = seed1 or "seed 1 data" in line
        if seed1 and "dsn   101/300" in line:
            break
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ckpt = tmp_path / "cut.ckpt.pt"
    assert ckpt.exists() and len(cut.read_text().splitlines()) == 2  # seed 0's two models, nothing more
    resumed = subprocess.run(args + ["--out", str(cut), "--resume"], capture_output=True, text=True, timeout=200)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "dsn (seed 1): resumed at step" in resumed.stderr and not ckpt.exists()
    full = [json.loads(line) for line in (tmp_path / "full.jsonl").read_text().splitlines()]
    got = [json.loads(line) for line in cut.read_text().splitlines()]
    keys = ("model", "seed", "source_accuracy", "target_accuracy", "history", "private_codes")
    assert [{k: r.get(k) for k in keys} for r in got] == [{k: r.get(k) for k in keys} for r in full]
