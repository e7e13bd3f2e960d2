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

import math
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


def median_range(known: Sequence[float], unknown: int = 1) -> tuple[float, float]:
    """The lower median of the norms of a part's contributions (``clip_scales``'s), when we
    know ``known`` of them and ``unknown`` more may be anything: (lowest, highest) it can be
    (0 and inf when the unknown ones can decide it alone)."""
    o = sorted(known)
    t = (len(o) + unknown - 1) // 2  # the lower median's index among all the norms
    return (o[t - unknown] if t >= unknown else 0.0), (o[t] if t < len(o) else math.inf)


def mean_consistent(norm: float, error: float, reducer_share: float, reducer_norm: float,
                    terms: Sequence[tuple[float, float, float | None, float]]) -> bool:
    """Whether a reduced part ``m`` (decoded; ``norm`` = ||m||, ``error`` its encoding's
    ``Codec.error_bound``) can be its reducer's clipped weighted mean of its contributions.
    The mean is ``sum_i share_i s_i x_i`` (``share_i`` = weight_i / the contributors' total
    weight, ``s_i`` the clip scale in [lowest_i, 1]), so

        ||m||^2 - sum_{i != reducer} share_i s_i <m, x_i>  =  <m, m - mean>  +  share_r s_r <m, x_r>,

    whose size is at most ``norm * (error + reducer_share * reducer_norm)``, where
    ``reducer_norm`` bounds the reducer's own clipped slice (``clip`` x the highest lower median:
    its slice is its word, up to that). Each other contributor reported ``<m, x_i>`` (``terms``:
    (share, lowest scale, dot or None when it did not say, its norm: ``|dot| <= norm x its
    norm``)). False when no scales in their ranges make the two sides meet: a mean its
    inputs cannot give (negated, another vector, scaled up), caught inside the round from one
    number per member. A reducer's own slice stays its word, as for any contributor."""
    if not math.isfinite(error) or not math.isfinite(reducer_norm):
        return True
    lo = hi = norm * norm
    scale = norm * (norm + reducer_share * reducer_norm)
    for share, lowest, dot, its_norm in terms:
        if dot is None:
            span = share * norm * its_norm
            lo, hi = lo - span, hi + span
        else:
            a, b = sorted((lowest * dot, dot))
            lo, hi = lo - share * b, hi - share * a
        scale += share * norm * its_norm
    allowed = norm * (error + reducer_share * reducer_norm) * (1 + 1e-5) + 1e-5 * scale  # fp32 sums' rounding
    return lo <= allowed and hi >= -allowed


def screen_mean(norm: float, error: float, clip: float, reducer_weight: float,
                others: Sequence[tuple[float, float | None, float | None]]) -> bool:
    """``mean_consistent`` for a part whose reducer has weight ``reducer_weight`` and whose
    other contributors reported ``others``: (weight, norm of its push as decoded or None, its
    dot with the mean or None). False only if the mean fits in no world with one liar besides
    the reducer: every other report true but one, whose norm and dot may be anything up to the
    clip, as may the reducer's own slice (its report is never used, so members that got it
    and members that did not, such as one that banned it, decide alike). A contributor that
    did not report is anything up to the clip too. So one lying member cannot make an honest
    mean fail, whatever it reports or withholds. True (nothing to say) for a plain mean
    (``clip`` 0: a slice may be anything), a part with no other contributor, weights that do
    not sum to a positive total, or a group too small for the clip to bound a liar."""
    total = reducer_weight + math.fsum(w for w, _, _ in others)
    if not clip or not others or not (total > 0 and math.isfinite(total)):
        return True
    silent = {i for i, (_, n, _) in enumerate(others) if n is None}

    def fits(liar: int | None) -> bool:
        unknown = silent | ({liar} if liar is not None else set())
        low, high = median_range([n for i, (_, n, _) in enumerate(others) if i not in unknown], len(unknown) + 1)
        if not math.isfinite(high):
            return True  # the unknown norms may set the clip: nothing bounds them
        cap = clip * high  # no contribution's clipped norm exceeds it
        terms = [(w / total, 0.0, None, cap) if i in unknown else
                 (w / total, 1.0 if n <= clip * low else clip * low / n, dot, n) for i, (w, n, dot) in enumerate(others)]
        return mean_consistent(norm, error, reducer_weight / total, cap, terms)

    speaking = [i for i in range(len(others)) if i not in silent]
    return any(fits(i) for i in speaking) if speaking else fits(None)


def clip_scales(norms: Sequence[float], clip: float) -> list[float]:
    """Per contribution, the factor (at most 1) that brings its norm down to ``clip`` times the
    lower median of ``norms``; all 1.0 when ``clip`` is 0 (the plain mean) or for one norm."""
    if not clip or len(norms) < 2:
        return [1.0] * len(norms)
    bound = clip * sorted(norms)[(len(norms) - 1) // 2]
    return [1.0 if n <= bound else bound / n for n in norms]
