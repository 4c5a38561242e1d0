"""The random masks a parallelized model draws, from the documented rule alone: the reference's generator.

``bigconv.ops.random`` documents its draws as a counter-based hash (lowbias32) of the seed, the forward's number,
the draw's number within that forward and the position's *global* row-major linear index. Written out:

- ``mix(h)``: ``h ^= h >> 16; h = h * 0x7FEB352D mod 2**32; h ^= h >> 15; h = h * 0x846CA68B mod 2**32;
  h ^= h >> 16``;
- a forward's base: ``mix(mix(mix(seed mod 2**32) ^ (seed >> 32 mod 2**32)) ^ mix(forward) ^ mix(stream +
  0x9E37))`` (the seed's high half joins unmixed), forwards numbered from 1 (every forward of the model
  counts), stream 0 for one replica;
- draw ``c`` of a forward (numbered from 1, in call order): ``key = mix(base ^ mix(c * 0x68E31DA4 mod 2**32))``;
- 32 bits at linear index ``i`` (``i < 2**32``): ``a = mix(i ^ mix(key))``;
- dropout with probability ``p`` keeps a position where ``a >= ceil(p * 2**32)``, scaled by ``1 / (1 - p)``;
- a uniform in float64: ``b = mix(a ^ 0x27D4EB2F)``, ``((a << 21) | (b >> 11)) * 2**-53``; ``bernoulli_(q)`` is
  ``uniform < q`` (timm's ``DropPath`` draws one per image: index ``n`` of an ``(N, 1, 1, 1)`` tensor).

The tests' references draw with this, not with ``bigconv.ops.random.RandomDraws`` (the library's own code),
so a change of the library's draws fails them; ``test_resume_draws`` checks this generator against
``RandomDraws`` directly too.
"""

from __future__ import annotations

import math

import torch

M32 = 0xFFFFFFFF


def mix(h):
    """lowbias32 of a Python int, or elementwise of an int64 tensor of values below 2**32 (its products wrap in
    int64 and keep their low 32 bits)."""
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & M32
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & M32
    return h ^ (h >> 16)


class Forward:
    """The keys of forward number ``forward`` of a model drawing with ``seed``: ``key()`` gives the next draw's."""

    def __init__(self, seed: int, forward: int, stream: int = 0) -> None:
        self.base = mix(mix(mix(seed & M32) ^ ((seed >> 32) & M32)) ^ mix(forward & M32) ^ mix(stream + 0x9E37))
        self.count = 0

    def key(self) -> int:
        self.count += 1
        return mix(self.base ^ mix((self.count * 0x68E31DA4) & M32))


def bits(shape, key: int) -> torch.Tensor:
    """32 random bits at each position of a whole tensor of ``shape`` (row-major linear index)."""
    index = torch.arange(math.prod(shape), dtype=torch.int64).reshape(tuple(shape))
    assert index.numel() <= 2 ** 32  # larger tensors hash the index's high half too (not needed here)
    return mix(index ^ mix(key))


def uniform(shape, key: int) -> torch.Tensor:
    """U[0, 1) in float64 (53 bits) at each position."""
    a = bits(shape, key)
    b = mix(a ^ 0x27D4EB2F)
    return ((a << 21) | (b >> 11)).to(torch.float64) * 2.0 ** -53


def dropout(x: torch.Tensor, p: float, key: int) -> torch.Tensor:
    """``F.dropout(x, p)`` in training with this draw's mask."""
    keep = (bits(x.shape, key) >= math.ceil(p * 2.0 ** 32)).to(x.dtype)
    return x * (keep / (1.0 - p))


def drop_path(x: torch.Tensor, p: float, key: int) -> torch.Tensor:
    """timm's ``DropPath(p)`` in training (scaled by keep) with this draw's per-image mask."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 1)
    keep = (uniform(shape, key) < 1.0 - p).to(x.dtype)
    return x * (keep / (1.0 - p))
