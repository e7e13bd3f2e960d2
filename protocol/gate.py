"""The direction gate of the robust mean (a run's ``sync.gate``): after the clip
(``protocol.butterfly.clip_scales``), contributions that point against the others' sum count
for nothing, and the mean is over the weight kept.

With terms ``t_i = share_i s_i x_i`` over the contributions still kept (K), contribution i
points *against the others* when ``along_i = <x_i, sum_{j in K, j != i} t_j> < 0``. One at a
time, the one whose cosine with the others' sum is the lowest is taken out and the dots are
taken again over those left; it stops when none points against the others, when taking the
next out would put more than ``GATE_MOST`` (a third) of the part's weight out, or when it is
the last one kept. So a liar aimed at one honest member's push (turning the others' sum
against it) is taken out first, and the honest one, with the liar's term gone, is kept: a
rule that took out every contribution against the others at once took both, or, over the
weight limit, neither. In a group of two nothing is taken out (each is half the weight).

Every check of a reducer applies the same rule from the same inputs: the reducer
(``peer.allreduce_round.Round.reduce``), the simulation, and the audit (``protocol.audit``),
which cannot know the reducer's float rounding: a dot within ``GATE_MARGIN`` of 0, two
cosines within it of each other, or a gated weight at the limit within a rounding may have
gone either way, and ``Gate.possible`` gives every outcome such choices allow. All of it works
on the contributions' Gram matrix (float64), which the reducer sums chunk by chunk as it
decodes the pushes once (``gram``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch

from protocol.butterfly import GATE_MOST, GATE_SLACK, clip_scales

GATE_MARGIN = 1e-6
"""A dot within this x the contribution's norm x the sum of the kept terms' norms of 0 (what a
float64 sum of the same products in any order can be off by, however the terms cancel), or
two cosines that close, may be decided either way by an auditor (``Gate.possible``): the
reducer and the auditor sum in other orders, and neither decision may convict. (A margin
relative to the sums' own norms was too small where two huge terms cancel: a review's repro
convicted an honest reducer that way.)"""
GATE_CHOICES = 256
"""Most sets of gated contributions an audit recomputes a mean for."""
GATE_STEPS = 4096
"""Most steps (sets of contributions still kept) an audit follows."""


def gram(blocks: Iterable[Sequence[torch.Tensor]]) -> torch.Tensor:
    """The Gram matrix (float64, n x n) of n vectors given as ``blocks``: each a sequence of the
    n vectors' pieces over the same elements (one decoded chunk of each contribution)."""
    out: torch.Tensor | None = None
    for block in blocks:
        x = torch.stack([b.to(torch.float64) for b in block])
        out = x @ x.T if out is None else out.add_(x @ x.T)
    if out is None:
        raise ValueError("no blocks")
    return out


class Gate:
    """The gate over one part's contributions: ``terms[i]`` = share x clip scale, ``shares[i]``
    the weight share, ``g`` their slices' Gram matrix."""

    def __init__(self, terms: Sequence[float], shares: Sequence[float], g: torch.Tensor):
        self.t = torch.tensor([float(x) for x in terms], dtype=torch.float64)
        self.shares = [float(x) for x in shares]
        self.g = g.to(torch.float64)
        self.n = len(self.shares)
        self.norms = torch.diagonal(self.g).clamp(min=0.0).sqrt()
        self.live = frozenset(i for i in range(self.n) if self.t[i] > 0 and self.norms[i] > 0)
        whole = math.fsum(self.shares)
        self.whole = whole if whole > 0 else 1.0

    def _view(self, kept: frozenset[int]) -> dict[int, tuple[float, float, float, float]]:
        """Per contribution in ``kept``: (along, room, cosine with the others' sum, how far a
        rounding may move that cosine)."""
        k = sorted(kept)
        at = torch.tensor(k)
        g, t, norms = self.g[at][:, at], self.t[at], self.norms[at]
        tg = g @ t  # <x_i, sum of the kept terms>
        whole_sq = max(0.0, float(t @ tg))
        span = float(t @ norms)  # the kept terms' norms: what any order's rounding is relative to
        diag = torch.diagonal(g)
        along = (tg - t * diag).tolist()
        rest = (whole_sq - 2.0 * t * tg + t * t * diag).clamp(min=0.0).sqrt().tolist()
        room = (GATE_MARGIN * span * norms).tolist()
        n = norms.tolist()
        return {i: (along[a], room[a], along[a] / (n[a] * rest[a]), room[a] / (n[a] * rest[a])) if rest[a] > 0
                else (along[a], room[a], 0.0, math.inf) for a, i in enumerate(k)}

    def _over(self, out: frozenset[int]) -> float:
        """How far the weight of ``out`` is over ``GATE_MOST`` of the whole, relative to it."""
        return math.fsum(self.shares[i] for i in out) / self.whole - GATE_MOST

    def gated(self) -> frozenset[int]:
        """Those a reducer takes out (the module docstring's rule)."""
        kept, out = self.live, frozenset()
        while len(kept) > 1:
            view = self._view(kept)
            against = [i for i in sorted(kept) if view[i][0] < 0]
            if not against:
                break
            i = min(against, key=lambda j: (view[j][2], j))
            if self._over(out | {i}) > GATE_SLACK:
                break
            kept, out = kept - {i}, out | {i}
        return out

    def possible(self) -> set[frozenset[int]] | None:
        """Every set an honest reducer may have taken out, given that it rounded otherwise: at
        each step, any contribution whose dot is within its room of 0 may have been seen
        either side of it, any whose cosine is within a rounding of the lowest may have been the
        lowest, and a weight at the limit within 1e-12 may have stopped it or not. None when
        that gives more than ``GATE_CHOICES`` sets or ``GATE_STEPS`` steps: only pushes placed
        on the gate's line on purpose do that."""
        found: set[frozenset[int]] = set()
        seen_steps: set[frozenset[int]] = set()

        def explore(kept: frozenset[int], out: frozenset[int]) -> bool:
            if kept in seen_steps:
                return True  # (``out`` is ``live - kept``: the same step by another path)
            seen_steps.add(kept)
            if len(seen_steps) > GATE_STEPS or len(found) > GATE_CHOICES:
                return False
            if len(kept) <= 1:
                found.add(out)
                return True
            view = self._view(kept)
            sure = [i for i in kept if view[i][0] < -view[i][1]]
            maybe = [i for i in kept if abs(view[i][0]) <= view[i][1]]
            if not sure:
                found.add(out)  # it may have seen none against the others, or any of ``maybe`` alone
                picks = sorted(maybe)
            else:  # the lowest cosine of those it saw against the others, whatever the rounding
                lowest = min(view[i][2] + view[i][3] for i in sure)
                picks = sorted(i for i in set(sure) | set(maybe) if view[i][2] - view[i][3] <= lowest)
            for i in picks:
                over = self._over(out | {i})
                if over > GATE_SLACK + 1e-12:
                    found.add(out)
                    continue
                if over > GATE_SLACK - 1e-12:
                    found.add(out)  # at the limit: it may have stopped here
                if not explore(kept - {i}, out | {i}):
                    return False
            return True

        return found if explore(self.live, frozenset()) and len(found) <= GATE_CHOICES else None


def gated_factors(scales: Sequence[float], shares: Sequence[float], gated: frozenset[int]) -> list[float]:
    """Per contribution, what its share is multiplied by when ``gated`` are taken out: 0 for
    those, and for the others their clip scale x the whole weight over the weight kept (the
    mean is over the contributions kept, each at its clip scale)."""
    if not gated:
        return list(scales)
    whole = math.fsum(shares)
    kept = whole - math.fsum(shares[i] for i in gated)
    return [0.0 if i in gated else s * whole / kept for i, s in enumerate(scales)]


def gates(n: int, clip: float, gate: bool) -> bool:
    """Whether the gate acts on a part of ``n`` contributions under the run's ``clip`` and
    ``gate``: with a clip (``clip`` 0 is the plain mean) and three contributions or more."""
    return gate and bool(clip) and n >= 3


def robust_factors(norms: Sequence[float], shares: Sequence[float], clip: float, gate: bool,
                   gram_of: Callable[[], torch.Tensor]) -> tuple[list[float], frozenset[int]]:
    """Per contribution, what its share is multiplied by in the mean: its ``clip_scales``
    factor, or, where the direction gate acts (``gates``), 0 for those it takes out and the
    kept ones' factors raised so that the mean is over the weight kept (``gated_factors``).
    ``gram_of()``: the slices' Gram matrix, asked for only when the gate acts.
    -> (factors, gated)."""
    scales = clip_scales(norms, clip)
    if not gates(len(norms), clip, gate):
        return scales, frozenset()
    out = Gate([s * c for s, c in zip(shares, scales)], shares, gram_of()).gated()
    return gated_factors(scales, shares, out), out
