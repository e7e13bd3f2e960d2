"""Butterfly all-reduce arithmetic: who reduces which slice, and what it costs on the wire.

In a group of n members, a flat vector of N elements is cut into n contiguous slices (the
first ``N % n`` slices one element longer). Member j reduces slice j: every other member
sends it its encoded slice j, member j accumulates them in fp32 with its own (unencoded)
values, encodes the weighted mean once, and sends that back to the n-1 others. Every member,
reducer included, then uses the *decoded* mean, so all members hold bit-identical results.

Robust mean: before accumulating, the reducer measures every contribution's norm (its own
slice's, and each foreign slice's as decoded) and scales down any above ``clip`` times the
*lower* median of those norms (``clip_scales``). The reducer trusts its own slice, and a
lower median is an honest member's norm, or bounded by two of them, as long as fewer than
half the contributors are larger than every honest one; in a group of two it is the smaller
norm. So one member's slice moves the mean by at most ``clip`` times an honest norm times its
weight share, whatever it sent (x1000, 1e30). Honest pseudo-gradients of one round have
norms within a few percent of each other, so with ``clip`` = 2 honest rounds are never
scaled (``bench/quality.py`` measures it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def slice_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """[start, end) of each member's slice of a vector of ``numel`` elements."""
    if n < 1 or numel < 0:
        raise ValueError(f"need n >= 1 and numel >= 0, got n={n} numel={numel}")
    base, extra = divmod(numel, n)
    out, start = [], 0
    for j in range(n):
        end = start + base + (1 if j < extra else 0)
        out.append((start, end))
        start = end
    return out


def bytes_sent(numel: int, n: int, encoded_size: Callable[[int], int]) -> list[int]:
    """Bytes each member sends in one all-reduce of ``numel`` elements among ``n`` members:
    its n-1 foreign slices to their reducers, plus its reduced slice to the n-1 others."""
    bounds = slice_bounds(numel, n)
    sizes = [encoded_size(e - s) for s, e in bounds]
    total = sum(sizes)
    return [(total - sizes[j]) + (n - 1) * sizes[j] for j in range(n)]


def slice_norm(x: torch.Tensor) -> float:
    """The L2 norm of a slice, in float64 (no overflow for any finite float32 values)."""
    return float(torch.linalg.vector_norm(x, dtype=torch.float64))


MEAN_SLACK = 2.0
"""Room in ``mean_norm_bound`` for the codec's rounding of the pushes and of the mean."""


def mean_norm_bound(others: Sequence[float], clip: float) -> float | None:
    """How large the norm of a reduced part can be, given the norms that its contributors other
    than its reducer report for their own slices of it (``others``; or, when the reducer
    counted nobody else, every other member's): None when nothing bounds it (no clipping, or
    no such report). Each contribution is scaled to at most ``clip`` times the lower median of
    all contributions' norms, and that lower median is at most the largest norm of a
    contributor other than the reducer (at least two norms are at or above a lower median).
    A weighted mean is no larger than its largest term, so an honest reducer's mean stays
    within ``max(1, clip) * max(others)``, times ``MEAN_SLACK`` for rounding. A reducer's own
    norm is its word and is left out; a member that under-reports can make an honest part
    look too large, which makes every member fall back on it alike, nothing more."""
    if not clip or not others:
        return None
    return MEAN_SLACK * max(1.0, clip) * max(others)


def clip_scales(norms: Sequence[float], clip: float) -> list[float]:
    """Per contribution, the factor (at most 1) that brings its norm down to ``clip`` times the
    lower median of ``norms``; all 1.0 when ``clip`` is 0 (the plain mean) or for one norm."""
    if not clip or len(norms) < 2:
        return [1.0] * len(norms)
    bound = clip * sorted(norms)[(len(norms) - 1) // 2]
    return [1.0 if n <= bound else bound / n for n in norms]
