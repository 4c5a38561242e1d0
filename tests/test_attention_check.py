"""``bigconv.check`` says how much of a model is split over the workers (issue 37, item 7).

A model whose tokens are gathered whole (attention between all positions) runs replicated: "Decomposable:
yes" alone would hide that every worker computes the whole model. The report gives the share of the
layers' compute and output activations that is split, and warns when most is replicated; Swin's
window attention (split by ``bigconv.ops.windows``) and a ViT's ring attention, class token included,
count as split, a CNN almost entirely so.
A failure points at ``bigconv.check``'s ``_work``/``split_share`` or at the layer hook's split test.
"""

from __future__ import annotations

import pytest

from bigconv.check import layer_report, report, split_share
from bigconv.compat import allow_torchvision_without_ops

allow_torchvision_without_ops()


def _timm(name, **kw):
    import timm

    return timm.create_model(name, pretrained=False, num_classes=3, **kw)


def _share(model, shape, grid=(2, 2), attention=None):
    rows, error = layer_report(model, shape, grid, attention=attention)
    assert error is None, error
    return rows, split_share(rows)


@pytest.mark.timeout(300)
def test_vit_with_class_token_reported_split_its_ring_buffers_counted():
    """timm's ViT as it ships (class token): its blocks by ring attention, the class token whole in front
    (``bigconv.ops.prefix``), only the head replicated; the ring's extra bytes count the class token's query."""
    attention, extra = [], []
    model = _timm("vit_small_patch16_224", img_size=128, depth=2)
    rows, error = layer_report(model, (1, 3, 128, 128), (2, 2), attention=attention, attention_bytes=extra)
    assert error is None, error
    share = split_share(rows)
    assert [name for name, _, _ in attention] == ["blocks.0.attn", "blocks.1.attn"], attention
    assert all(s.startswith("ring:") and "and 1 whole token in front" in s for _, _, s in attention), attention
    assert share["compute"] > 0.95 and share["activations"] > 0.95 and share["replicated_layers"] == 1, share
    # 8x8 tokens, 4x4 per worker, 6 heads of 64, float32: two blocks of 16 keys and values with their gradients
    # in flight, two (16 + 1 class token) x 16 score tiles
    assert extra == [4 * 6 * (2 * 16 * 2 * 128 + 2 * 17 * 16)] * 2, extra
    text = report({"model": "vit", "input": [1, 3, 128, 128], "workers": 4, "grid": [2, 2], "decomposable": True,
                   "layers": [r.__dict__ for r in rows], "split": share, "memory": None, "exactness": None})
    assert "Split over the workers: " in text and "WARNING" not in text, text


@pytest.mark.timeout(300)
def test_mostly_replicated_reported_with_a_warning():
    """Tokens gathered whole before attention (an op bigconv does not split on them): the warning and its way out."""
    rows, _ = _share(_timm("resnet18"), (1, 3, 64, 64))
    share = {"compute": 0.01, "activations": 0.02, "replicated_layers": 9, "layers": 10}
    attention = [{"module": "blocks.0.attn", "type": "Attention", "strategy": "replicated: its input was already whole"}]
    text = report({"model": "vit", "input": [1, 3, 128, 128], "workers": 4, "grid": [2, 2], "decomposable": True,
                   "layers": [r.__dict__ for r in rows], "split": share, "attention": attention, "memory": None,
                   "exactness": None})
    assert "WARNING: most of this model runs replicated" in text and "tokens gathered whole before attention" in text


@pytest.mark.timeout(300)
def test_swin_windows_and_cnn_reported_split():
    attention = []
    _, swin = _share(_timm("swin_tiny_patch4_window7_224", img_size=112, depths=(2, 2, 2), num_heads=(3, 6, 12)),
                     (1, 3, 112, 112), attention=attention)
    strategies = {name: s.split(":")[0] for name, _, s in attention}
    assert strategies["layers.0.blocks.0.attn"] == "split" and strategies["layers.1.blocks.1.attn"] == "split"
    assert strategies["layers.2.blocks.0.attn"] == "windows held whole (fewer windows than workers)", strategies
    assert swin["compute"] > 0.85 and swin["activations"] > 0.9 and swin["replicated_layers"] == 5, swin
    _, cnn = _share(_timm("resnet18"), (1, 3, 64, 64))
    assert cnn["compute"] > 0.95 and cnn["replicated_layers"] <= 2, cnn


@pytest.mark.timeout(300)
def test_botnet_attention_named_ring_with_its_buffers_counted():
    """botnet's global MHSA runs by ring attention (bigconv.ops.global_attention): check names it, and the bytes of
    its ring buffers and score tiles (a gathered form: whole keys and scores, more) reach the memory estimate."""
    from bigconv.ops.global_attention import use

    for strategy in ("ring", "gathered"):
        attention, extra = [], []
        model = _timm("botnet26t_256")
        if strategy == "gathered":
            use(model, "gathered")
        rows, error = layer_report(model, (1, 3, 256, 256), (2, 2), attention=attention, attention_bytes=extra)
        assert error is None, error
        assert {t for _, t, _ in attention} == {"BottleneckAttn"}, attention  # not the SelfAttnBlocks holding them
        named = {n: s for n, t, s in attention if t == "BottleneckAttn"}
        assert len(named) == 3 and all(s.startswith(f"{strategy}:") for s in named.values()), named
        assert split_share(rows)["compute"] > 0.95
        # the largest: stages.3.0, a 16x16 map, 8x8 per worker, 4 heads of 128 dims, float32; ring: two blocks
        # of 64 keys and values with their gradients, two 64x64 score tiles; gathered: 256 keys and values,
        # two 64x256 score matrices
        assert max(extra) == (4 * 4 * (2 * 64 * 2 * 256 + 2 * 64 * 64) if strategy == "ring"
                              else 4 * 4 * (256 * 256 + 2 * 64 * 256)), extra


def test_memory_hint_for_a_model_built_for_one_size():
    """A ViT built for 1024 px fails the estimate's plain runs at 128 px on timm's size assertion: larger
    --memory-edges would not help (the old hint), a model built for any size would."""
    from bigconv.check import memory_hint

    timm_error = "AssertionError: Input height (128) doesn't match model (1024)."
    assert "dynamic_img_size=True" in memory_hint(timm_error, (128, 256)) and "larger" not in memory_hint(
        timm_error, (128, 256))
    other = "Expected more than 1 value per channel when training"
    assert memory_hint(other, (128, 256)) == "try larger --memory-edges"


@pytest.mark.timeout(300)
def test_auto_attention_gathers_where_the_stated_memory_holds_the_keys(monkeypatch):
    """``use(model, "auto", memory=M)``: each global attention call gathers its keys where the largest shard's
    gathered keys and scores fit ``M`` bytes, else runs the ring; ``check`` names the choice per layer, and the
    dry run's shards call what it names (counted in the rule: ``_gathered`` and ``_RingAttention.apply``)."""
    import torch

    from bigconv.engine.dry_run import dry_run, meta_copy
    from bigconv.ops import global_attention as ga

    model = _timm("botnet26t_256")
    with pytest.raises(ValueError, match="goes with strategy 'auto'"):
        ga.use(model, "auto")
    with pytest.raises(ValueError, match="positive number of bytes"):
        ga.use(model, "auto", memory=-1)
    # botnet's largest attention gathered (stages.3.0: a 16x16 map, 8x8 per worker, 4 heads of 128) holds
    # 4*4*(256*256 + 2*64*256) bytes = 1.5 MiB (test above); the other two hold less: 1 MiB lets those two
    # gather and keeps the largest on the ring
    ga.use(model, "auto", memory=2**20)
    attention, extra = [], []
    rows, error = layer_report(model, (1, 3, 256, 256), (2, 2), attention=attention, attention_bytes=extra)
    assert error is None, error
    named = {n: s.split(":")[0] for n, t, s in attention if t == "BottleneckAttn"}
    assert sorted(named.values()) == ["gathered", "gathered", "ring"], named
    assert named["stages.3.0.self_attn"] == "ring", named
    calls = {"gathered": 0, "ring": 0}

    def counted(kind, inner):
        def call(plan, *a):
            if not isinstance(plan.ctx, ga.Alone):  # a shard's call, not the dry run's one-process shape check
                calls[kind] += 1
            return inner(plan, *a)
        return call

    monkeypatch.setattr(ga, "_gathered", counted("gathered", ga._gathered))
    monkeypatch.setattr(ga._RingAttention, "apply", counted("ring", ga._RingAttention.apply))
    dry_run(meta_copy(model), (2, 2), (1, 3, 256, 256), torch.float32, True)
    assert calls == {"gathered": 4 * 2, "ring": 4 * 1}, calls  # four shards, each layer's choice on each
    ga.use(model, "auto", memory=2**30)  # everything fits: all gathered
    attention = []
    layer_report(model, (1, 3, 256, 256), (2, 2), attention=attention)
    assert {s.split(":")[0] for n, t, s in attention if t == "BottleneckAttn"} == {"gathered"}, attention
