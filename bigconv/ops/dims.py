"""Dim arithmetic the rules share: dim arguments as torch takes them, and sizes given as varargs.

Positions of spatial dims are kept negative (counted from the end, so broadcasting leaves them put);
``dim`` arguments come in either sign, and are made non-negative to compare with them.
"""

from __future__ import annotations

from typing import Iterable

import torch


def nonneg_dims(dims: Iterable[int], ndim: int) -> list[int]:
    return [d % ndim for d in dims]


def neg_dims(dims: Iterable[int], ndim: int) -> tuple[int, ...]:
    return tuple(d - ndim for d in dims)


def int_dims(dim, ndim: int) -> list[int]:
    """A ``dim`` argument (None for every dim, an int or a sequence) as non-negative dims."""
    if dim is None:
        return list(range(ndim))
    return nonneg_dims([dim] if isinstance(dim, int) else list(dim), ndim)


def size_args(args) -> list[int]:
    """A size given as varargs (``x.expand(2, 3)``) or as one sequence (``x.expand((2, 3))``)."""
    if len(args) == 1 and isinstance(args[0], (list, tuple, torch.Size)):
        return list(args[0])
    return list(args)
