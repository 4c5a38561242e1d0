"""Models returning several outputs train and predict exactly (issue 37): lists, tuples, dicts.

nnU-Net's deep supervision (maps at two scales, a loss over a list of targets), HoVerNet's dict of
heads, an auxiliary classifier beside a dense map, two classifier heads. Each against one process
in float64 on a 2x2 grid, both transports: every output, the input gradient, every parameter
gradient, both losses and every weight after two SGD steps, each against its own size (raw, no
noise floor). A failure points at the dry run's output structure (``DryRunResult.outputs``), the
driver's join and per-output gradients (``ParallelModel._loss_on_driver``, ``_assemble``) or the
workers' backward through several outputs (``ModelPart.step`` with the driver's output gradients). SPMD: ``test_issue37_spmd.py``.
"""

from __future__ import annotations

import pytest

import bigconv
from exactness import assert_exact, compare
from issue37_models import CASES, DeepSupervision, case


@pytest.mark.world(4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(CASES))
def test_several_outputs_match_single_process(world, transport, name):
    model, x, y, loss = case(name)
    r = compare(model, world, x, y, loss, grid=(2, 2), transport=transport)
    assert_exact(r)


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_several_outputs_refusals_before_remote_work(world, monkeypatch):
    model, x, y, loss = case("deep-supervision")
    net = bigconv.parallelize(model, world, grid=(2, 2))
    monkeypatch.setattr(net, "_launch", lambda *_: pytest.fail("remote work started"))
    with pytest.raises(ValueError, match="OME-TIFF holds one image per output, but this batch has 2"):
        net.predict(x, "/tmp/unused.ome.tif")
    with pytest.raises(ValueError, match="loss_fn cannot take the model's outputs"):
        net.gradients(x, [y[0], y[0]], loss)  # the half-resolution target has the wrong shape

    class ReturnsNone(DeepSupervision):
        def forward(self, x):
            return [super().forward(x)[0], None]

    net = bigconv.parallelize(ReturnsNone().double(), world, grid=(2, 2))
    with pytest.raises(ValueError, match="list, tuple or dict of tensors"):
        net(x)


@pytest.mark.world(4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(CASES))
def test_compare_training_judges_every_output(world, name):
    """The user-facing verdict (``bigconv.verify.compare_training``) on several outputs: each output tensor is
    judged on its own (``output[0]``, ``output['aux']``), and the sabotage panel's doubled output is flagged."""
    import copy

    from verdicts import assert_exact

    from bigconv.sabotage import run_panel
    from bigconv.verify import compare_training

    model, x, y, loss = case(name)
    r = compare_training(copy.deepcopy(model), world, x, y, loss, grid=(2, 2))
    assert_exact(r)
    outputs = [t["tensor"] for t in r["tensors"] if t["category"] == "forward"]
    assert len(outputs) > 1 and all(o.startswith("output[") for o in outputs), outputs
    panel = run_panel(name, model, world, x, y, loss, (2, 2))
    assert panel["clean"] == "exact" and panel["sabotaged"]["doubled output"] == "not exact", panel
