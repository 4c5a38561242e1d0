"""The op rules as one frozen table, merged from the rule modules' own tables.

Each rule module (``layout``, ``reduce``, ``window``, ``norm``) exports constant tables of what it
handles; nothing registers itself by being imported. A function claimed by two modules is a bug in
the rules, and raises here, at import.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping

import torch
import torch.nn.functional as F

from . import (
    global_attention, layout, norm, positions, prefix, random, reduce, roll, sdpa, subpixel, unfold, window, windows,
)

MODULES = (layout, reduce, window, norm, subpixel, positions, random, roll, windows, unfold, global_attention, sdpa)


def _merge(name: str) -> Mapping:
    return _merge_from(MODULES, name)


def _merge_from(modules, name: str) -> Mapping:
    merged: dict = {}
    for module in modules:
        for key, rule in getattr(module, name).items():
            if key in merged:
                raise RuntimeError(f"{key!r} has a rule in two modules of bigconv.ops ({name}); keep one")
            merged[key] = rule
    return MappingProxyType(merged)


RULES: Mapping[Callable, Callable] = _merge("RULES")
"""Rules for calls with a sharded argument: ``rule(mode, func, args, kwargs)``."""
WHOLE_RULES: Mapping[Callable, Callable] = _merge("WHOLE_RULES")
"""Rules for calls without one that may build a sharded result (factories, upsampling a whole map)."""
PROPERTY_RULES: Mapping[str, Callable] = _merge("PROPERTY_RULES")
"""Rules for tensor attributes (``x.shape``), by name."""
LAYOUT_AWARE: frozenset = frozenset().union(*(m.LAYOUT_AWARE for m in MODULES))
"""Functions whose rules handle spatial dims wherever they are; the others need them trailing."""
_POSITIONS = dict(_merge_from((positions, windows, prefix, unfold), "POSITION_RULES"))
# Indexing whole tokens in front of the positions (a ViT's class token: x[:, 0]); the rest, windows' rule.
_POSITIONS[torch.Tensor.__getitem__] = prefix.getitem(_POSITIONS[torch.Tensor.__getitem__])
# torch.cat along the positions: whole tokens in front (prefix); along another dim: windows' rule
_POSITIONS.update({f: prefix.joining(_POSITIONS[f]) for f in (torch.cat, torch.concat, torch.concatenate)})
_POSITIONS[F.normalize] = prefix.not_over_whole(_POSITIONS[F.normalize], 2, 1)  # F.normalize(input, p, dim)
# SDPA over positions in its sequence dim is global attention (ring passes); in a batch dim, windows'.
_POSITIONS[F.scaled_dot_product_attention] = sdpa.over_positions(
    _POSITIONS[F.scaled_dot_product_attention])
POSITION_RULES: Mapping[Callable, Callable] = MappingProxyType(_POSITIONS)
"""Rules for calls given an image's positions flattened into one dim (``bigconv.ops.positions``)."""
POSITION_PROPERTY_RULES: Mapping[str, Callable] = MappingProxyType(dict(positions.POSITION_PROPERTY_RULES))
