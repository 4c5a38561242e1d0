"""``bigconv.check`` on issue 51's models (item 5): what it reports is what the run does.

The contract: check does not crash on a Conv1d across the channels of a 2D model with 'same' padding (ECA's
gate; it raised IndexError in its own copy of the 'same'-padding arithmetic, now the run's
``bigconv.ops.window.conv_windows``), with ``--no-exact``; it names each attention module's strategy from what
the attention rules recorded in the dry run (``ops.shards.AttentionNote``): FastViT's attention, which flattens its
map inside, and MaxViT's grid attention are ring attention, MaxViT's block attention each worker's own windows;
a refusal's ``hold_whole`` way out is a module that can be held (SAM's Block around an Attention given tokens),
and holding it works (``tests/test_ops_attention_layouts.py``). A failure points at ``bigconv.check``'s
``windows``/``_from_notes`` or at the rules' ``note_attention`` calls.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from issue51_models import fastvit_like, maxvit
from test_ops_attention_layouts import TokenBlock

from bigconv import check
from bigconv.check import layer_report

MODELS = os.path.join(os.path.dirname(__file__), "issue51_models.py")


@pytest.mark.timeout(120)
def test_check_cli_on_a_same_padded_conv1d_across_channels(capsys):
    """``python -m bigconv.check tests/issue51_models.py:eca_net --no-exact``: no IndexError; the 2D convolutions are
    reported, the gate's Conv1d is not a windowed layer of the grid."""
    code = check.main([f"{MODELS}:eca_net", "--input", "1x3x32x32", "--workers", "4", "--no-exact", "--no-memory",
                       "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["decomposable"], report
    assert [row["module"] for row in report["layers"]] == ["conv", "head"], report["layers"]


def _strategies(model, shape, grid=(2, 2)):
    attention = []
    _, error = layer_report(model.double(), shape, grid, dtype=torch.float64, attention=attention)
    assert error is None, error
    return {name: s for name, _, s in attention}


@pytest.mark.timeout(120)
def test_check_names_the_strategy_the_run_took():
    """FastViT-style attention (a map in and out, flattened inside) rings; MaxViT's grid attention rings over its grid
    cells, its block attention is each worker's own windows."""
    flat = _strategies(fastvit_like(), (2, 3, 9, 7))
    assert flat["1"].startswith("ring: keys and values of all 63 positions"), flat
    torch.manual_seed(0)
    mx = _strategies(maxvit(), (2, 3, 32, 32))
    grid = [s for name, s in mx.items() if "attn_grid" in name]
    block = [s for name, s in mx.items() if "attn_block" in name]
    assert grid and all(s.startswith("ring:") for s in grid), mx
    assert block and all(s.startswith("split: each worker its own windows") for s in block), mx


@pytest.mark.timeout(120)
def test_check_names_a_module_that_can_be_held():
    """The refusal check reports inside a module given tokens names the block around it, not the refusing module."""
    model = torch.nn.Sequential(TokenBlock(), torch.nn.Conv2d(4, 3, 1))
    _, error = layer_report(model.double(), (2, 1, 9, 7), (2, 2), dtype=torch.float64)
    assert error is not None and "hold_whole(model, TokenBlock)" in str(error), error
