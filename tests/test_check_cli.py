"""``python -m bigconv.check``: the newcomer's "will my model work?" answers what the engine does.

A decomposable zoo model gets its layers (shards, halos, split or replicated), a memory estimate
and an exactness verdict; a refused zoo model gets the module, the op and the fix, and exit status 1.
A failure here points to ``bigconv/check.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bigconv.check import halo_width, layer_report, report
from bigconv.geometry.boxes import Window
from bigconv.harness.model_spec import build_model, parse_kwargs

ROOT = Path(__file__).resolve().parents[1]


def run_check(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bigconv.check", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(600)
def test_a_decomposable_zoo_model_reports_layers_memory_and_exactness():
    done = run_check("torchvision:resnet18:num_classes=3", "--input", "1x3x512x512", "--workers", "4", "--json",
                     "--memory-edges", "64,128", "--exact-size", "64", "--exact-workers", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout)
    assert r["decomposable"] and r["refusal"] is None and r["grid"] == [2, 2]
    conv1 = r["layers"][0]
    # 7x7 stride-2 padding-3 stem: 256x256 output, 128x128 per shard, a halo of 3 input rows
    assert (conv1["module"], conv1["output"], conv1["shard"], conv1["halo"]) == ("conv1", [256, 256], [128, 128],
                                                                               [3, 3])
    assert r["layers"][-1]["module"] == "fc" and not r["layers"][-1]["split"]
    assert r["layers"][-2]["receptive_field"] == 435  # ResNet-18's known receptive field
    m = r["memory"]
    assert m["measured"]["128"] > m["measured"]["64"] > 0
    assert m["ideal_per_process_bytes"] <= m["per_process_bytes"] < m["single_bytes"]
    e = r["exactness"]
    assert e["exact"] and e["workers"] == 2 and max(e["relative_errors"].values()) <= e["tolerance"]


def test_a_refused_zoo_model_names_module_op_and_fix():
    done = run_check("timm:lambda_resnet26t", "--input", "1x3x256x256", "--workers", "4", "--json")
    assert done.returncode == 1, done.stderr[-3000:]
    r = json.loads(done.stdout)
    assert not r["decomposable"] and r["memory"] is None and r["exactness"] is None
    msg = r["refusal"]["message"]
    # the op (its position lambdas' conv3d over the positions viewed back into a map), the module, the fix
    # that needs no change to the model: hold the attention module around it, not the conv
    assert "conv3d" in msg and "conv_lambda" in msg and "bigconv.hold_whole(model, LambdaLayer)" in msg
    assert "Decomposable: NO" in report(r) and "LambdaLayer" in report(r)


def test_bad_arguments_name_the_fix():
    done = run_check("resnet18", "--input", "1x3x64x64", "--no-memory", "--no-exact")
    assert done.returncode == 2 and "timm:resnet50" in done.stderr
    done = run_check("timm:resnet18", "--input", "64x64")
    assert done.returncode == 2 and "1x3x4096x4096" in done.stderr
    # A misspelt model: one line naming it with the closest names, no traceback (issue 53 item 8)
    for spec, close in (("timm:resnet_50", "timm:resnet50"), ("torchvision:resnet_18", "torchvision:resnet18")):
        for planner in ((), ("--gpus", "4", "--gpu", "h100-80gb")):
            done = run_check(spec, "--input", "1x3x64x64", "--no-memory", "--no-exact", *planner)
            assert done.returncode == 2 and done.stdout == "", done.stderr
            assert done.stderr.count("\n") == 1 and "resnet_" in done.stderr and close in done.stderr, done.stderr
    # A forgotten batch dim names the input shape, not a convolution to hold whole
    for planner in ((), ("--gpus", "4", "--gpu", "h100-80gb")):
        done = run_check("torchvision:resnet18", "--input", "3x1024x1024", "--no-memory", "--no-exact", *planner)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stdout + done.stderr
        assert "--input 3x1024x1024" in done.stderr and "1x3x1024x1024" in done.stderr, done.stderr


def test_replicated_maps_and_halos_follow_the_grid():
    """On a 4x1 grid, a map pooled to 2 rows (fewer than the 4 shards) runs whole on every worker until an
    upsampling makes it large enough to split again."""
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1), torch.nn.MaxPool2d(8),
                                torch.nn.Conv2d(2, 2, 3, padding=1), torch.nn.Upsample(scale_factor=8),
                                torch.nn.Conv2d(2, 2, 3, padding=1))
    rows, error = layer_report(model, (1, 1, 16, 16), (4, 1))
    assert error is None
    assert [(r.module, r.split) for r in rows] == [("0", True), ("1", False), ("2", False), ("4", True)]
    assert rows[0].halo == [1, 0]  # a 3x3 conv: one row from each neighbour, nothing across the uncut axis
    assert rows[1].shard == [2, 2] and rows[2].halo == [0, 0]  # whole maps need no halo
    assert rows[2].receptive_field == 3 + 7 + 2 * 8  # the conv after the pool sees 8 image pixels per position


def test_halo_width_of_a_dilated_window_on_thin_shards():
    # a dilation-4 3x3 conv with padding 4 over 4 shards of 10 rows reads 4 rows beyond each shard
    assert halo_width(Window(3, 1, 4, 4, 4), 40, 40, 4) == 4
    assert halo_width(Window(3, 1, 4, 4, 4), 40, 40, 1) == 0


def test_model_specs_and_file_builders(tmp_path):
    assert parse_kwargs("spatial_dims=2,channels=(4,8),norm=batch") == {"spatial_dims": 2, "channels": (4, 8),
                                                                        "norm": "batch"}
    (tmp_path / "mine.py").write_text("import torch\ndef build():\n    return torch.nn.Conv2d(1, 2, 3)\n")
    assert isinstance(build_model(f"{tmp_path / 'mine.py'}:build"), torch.nn.Conv2d)
    with pytest.raises(ValueError, match="my_model.py:build"):
        build_model(f"{tmp_path / 'missing.py'}:build")
    with pytest.raises(ValueError, match="bigconv has no model 'CNN2d'; did you mean bigconv:CNN2D"):
        build_model("bigconv:CNN2d")


def test_the_terminal_report_names_every_part():
    """The report a newcomer reads: the verdict, each layer's row, the memory estimate and exactness."""
    rows, error = layer_report(build_model("bigconv:CNN2D"), (1, 1, 64, 64), (2, 2))
    r = {"model": "bigconv:CNN2D", "input": [1, 1, 64, 64], "workers": 4, "grid": [2, 2], "decomposable": True,
         "refusal": None, "layers": [vars(row) for row in rows],
         "memory": {"method": "two plain runs", "single_bytes": 400 * 2**20, "per_process_bytes": 110 * 2**20,
                    "ideal_per_process_bytes": 100 * 2**20},
         "exactness": {"input": [2, 1, 64, 64], "workers": 4, "grid": [2, 2], "exact": True, "verdict": "exact",
                       "relative_errors": {"forward": 1e-16, "weights": 2e-16}, "wrong": [], "ill_conditioned": [],
                       "residues": 2, "rerun_at": None, "tolerance": 1e-9, "steps": 3,
                       "optimizer": "SGD(lr=0.05, momentum=0.9)", "reorderings": ["channels-last", "reversed batch"]}}
    text = report(r)
    assert "Decomposable: yes" in text and "features.0" in text and "32x32" in text  # a 2x2 grid's shard
    assert "one process: 400 MiB; each of 4 processes: 110 MiB (single / 4: 100 MiB)" in text
    assert ": EXACT (" in text and "forward 1.0e-16" in text and "2 residues" in text
    assert "3 steps of SGD(lr=0.05, momentum=0.9)" in text
    # What the verdict assumes and where its floor applies, said beside it
    assert "channels-last, reversed batch" in text and "no other floor" in text and "never floored" in text
    # An ill-conditioned result is never reported exact: it names the tensors and the size to rerun at.
    r["exactness"].update(exact=False, verdict="ill-conditioned at this size", rerun_at=[2, 1, 128, 128],
                          ill_conditioned=[{"category": "weights", "tensor": "bn.bias", "error": 1e-17,
                                            "scale": 1e-9, "noise": 1e-16}])
    text = report(r)
    assert ": ILL-CONDITIONED AT THIS SIZE (" in text and ": EXACT" not in text
    assert "weights bn.bias: noise 1.0e-16 of size 1.0e-09" in text and "rerun with --exact-size 128" in text


WRONG_ON_WORKERS = """
import os
import torch
import torch.nn as nn
import torch.nn.functional as F


class WrongOnWorkers(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pid):
        ctx.wrong = os.getpid() != pid
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return (g * 1.001 if ctx.wrong else g), None


class Net(nn.Module):
    def __init__(self, wrong):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout2d(0.3))
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5), nn.Linear(4, 3))
        self.wrong, self.pid = wrong, os.getpid()

    def forward(self, x):
        w = WrongOnWorkers.apply(self.conv.weight, self.pid) if self.wrong else self.conv.weight
        return self.head(F.conv2d(self.body(x), w, self.conv.bias, padding=1))


def right():
    return Net(False)


def wrong():
    return Net(True)
"""


@pytest.mark.timeout(600)
def test_the_check_can_fail(tmp_path):
    """A model in training mode (dropout drawn on both sides alike) is exact; the same model with a 0.1% error
    in its workers' backward reads NOT EXACT, names the tensors and exits 1."""
    (tmp_path / "nets.py").write_text(WRONG_ON_WORKERS)
    common = ["--input", "1x3x64x64", "--workers", "2", "--no-memory", "--exact-size", "24", "--json"]
    done = run_check(f"{tmp_path / 'nets.py'}:right", *common)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["exactness"]["verdict"] == "exact"
    done = run_check(f"{tmp_path / 'nets.py'}:wrong", *common)
    assert done.returncode == 1, done.stderr[-3000:]
    e = json.loads(done.stdout)["exactness"]
    assert e["verdict"] == "not exact" and e["wrong"] and e["wrong"][0]["category"] in ("param_grads", "weights")


STATE_OFF_ON_ONE_WORKER = '''
import torch
import torch.distributed as dist
import torch.nn as nn


class MomentumOffOnWorker1(torch.optim.SGD):
    """SGD with momentum whose buffers on worker 1 are 1e-6 off after the first step: the error acts on the
    weights from step 2 on, invisible to a check of one step."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, lr=lr, momentum=0.9)
        self.steps = 0

    def step(self, closure=None):
        out = super().step(closure)
        self.steps += 1
        if self.steps == 1 and dist.is_initialized() and dist.get_rank() == 1:
            for state in self.state.values():
                state["momentum_buffer"].mul_(1 + 1e-6)
        return out


class TwoHeads(nn.Module):
    """Several outputs: a dense map and a pooled vector, in a dict."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
        self.seg = nn.Conv2d(4, 2, 1)
        self.cls = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))

    def forward(self, x):
        h = self.body(x)
        return {"mask": self.seg(h), "label": self.cls(h)}


def build():
    return TwoHeads()
'''


@pytest.mark.timeout(600)
def test_the_check_judges_optimizer_state_over_three_steps_on_several_outputs(tmp_path):
    """A model with a dict of outputs is checked on each (MSE summed over them); 3 steps of the named optimizer by
    default; an optimizer whose momentum buffers go 1e-6 wrong on worker 1 after step 1 reads NOT EXACT naming
    worker 1 and the tensors (a one-step check, as before, could not see it); fewer than 3 steps are refused."""
    (tmp_path / "nets.py").write_text(STATE_OFF_ON_ONE_WORKER)
    model = f"{tmp_path / 'nets.py'}:build"
    common = ["--input", "2x1x32x32", "--workers", "2", "--no-memory", "--exact-size", "16"]
    done = run_check(model, *common, "--optimizer", "adam", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    e = json.loads(done.stdout)["exactness"]
    assert e["verdict"] == "exact" and e["steps"] == 3 and e["optimizer"].startswith("Adam(")
    assert e["relative_errors"]["optimizer"] <= e["tolerance"]
    done = run_check(model, *common, "--optimizer", f"{tmp_path / 'nets.py'}:MomentumOffOnWorker1")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "NOT EXACT" in done.stdout and "3 steps of MomentumOffOnWorker1" in done.stdout
    assert "workers disagree: weights body.0.weight on worker(s) 1" in done.stdout, done.stdout
    done = run_check(model, *common, "--optimizer", f"{tmp_path / 'nets.py'}:MomentumOffOnWorker1", "--json")
    apart = {t["tensor"]: t["workers"] for t in json.loads(done.stdout)["exactness"]["wrong"]
             if t["category"] == "replicas"}
    assert apart["optimizer body.0.weight.momentum_buffer"] == [1] and apart["weights seg.bias"] == [1], apart
    done = run_check(model, *common, "--exact-steps", "2")
    assert done.returncode == 2 and "at least 3 steps" in done.stderr


FIXED_SIZE = """import torch.nn as nn


def build():  # takes 1x100x100 inputs only: a Flatten before a Linear of fixed width
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 100 * 100, 2))
"""


def test_a_model_of_one_input_size_is_checked_and_planned_at_that_size(tmp_path, capsys):
    """Issue 53 item 3: a model that takes only its own input size is checked for exactness at that size (not
    the default 64² it cannot take), and planned on the grid itself where the planner's proxy image would be
    smaller; on a grid too large to dry-run whole, the planner says why it cannot price it, naming the input."""
    from bigconv.check import main as check_main

    (tmp_path / "fixed.py").write_text(FIXED_SIZE)
    spec = f"{tmp_path / 'fixed.py'}:build"
    done = run_check(spec, "--input", "1x1x100x100", "--workers", "4", "--no-memory", "--json")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    e = json.loads(done.stdout)["exactness"]
    assert e["input"] == [2, 1, 100, 100] and e["verdict"] == "exact", e
    code = check_main([spec, "--input", "1x1x100x100", "--gpus", "4", "--gpu", "h100-80gb", "--grid", "1x4", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["decomposable"] and r["plan"]["proxy_grid"] == [1, 4], r["refusal"]
    code = check_main([spec, "--input", "1x1x100x100", "--gpus", "32", "--gpu", "h100-80gb", "--grid", "4x8"])
    text = capsys.readouterr().out
    assert code == 1 and "Decomposable: yes, but this plan cannot be priced" in text, text
    assert "the model runs on the input (1, 1, 100, 100) but not on" in text and "at most 16 GPUs" in text, text
    done = run_check(spec, "--input", "1x1x100x100", "--workers", "4", "--no-memory", "--exact-size", "32")
    assert done.returncode == 0, done.stderr[-2000:]  # the given size is taken when --exact-size's is not
    big = FIXED_SIZE.replace("100 * 100", "768 * 768")
    (tmp_path / "big.py").write_text(big)
    done = run_check(f"{tmp_path / 'big.py'}:build", "--input", "1x1x768x768", "--workers", "4", "--no-memory")
    assert done.returncode == 1 and "Exactness: NOT CHECKED: the model does not take the exactness check's input " \
        "2x1x64x64" in done.stdout and "give --exact-size" in done.stdout, done.stdout[-2000:]
