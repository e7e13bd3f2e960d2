"""Butterfly all-reduce arithmetic: who reduces which slice, and what it costs on the wire.

In a group of n members, a flat vector of N elements is cut into n contiguous slices (the
first ``N % n`` slices one element longer; members the group record lists as ``idle`` get an
empty slice, and the others cut N as that many would). Member j reduces slice j: every other member
sends it its encoded slice j, member j accumulates them in fp32 with its own slice, encoded
and decoded alike (so its witnesses can vouch for it: ``witnesses_of``), encodes the weighted mean
once, and sends that back to the n-1 others. Every member, reducer included, then uses the
*decoded* mean, so all members hold bit-identical results.

Robust mean: before accumulating, the reducer measures every contribution's norm (its own
slice's, and each foreign slice's as decoded) and scales down any above ``clip`` times the
*lower* median of those norms (``clip_scales``). The reducer trusts its own slice, and a
lower median is an honest member's norm, or bounded by two of them, as long as fewer than
half the contributors are larger than every honest one; in a group of two it is the smaller
norm. So one member's slice moves the mean by at most ``clip`` times an honest norm times its
weight share, whatever it sent; one far beyond every honest norm (x1000, 1e30) counts for
nothing (``clip_scale``). Honest pseudo-gradients of one round have norms within a few
percent of each other: with ``clip`` = 1 (the default) the members above the lower median are
brought down to it, which cost honest runs 0.3% held-out loss in ``bench/quality.py``, and one
liar's push counts as one honest norm in whatever direction it chose (at ``clip`` = 2, twice
that: a constant direction cost +24% there, at 1 +2%).

Direction gate (the run's ``sync.gate``, on for runs made since it exists; ``protocol.gate``):
after the clip, the contribution pointing furthest against the sum of the others' terms (a
negative dot) counts for nothing, then the next against what is left, while the weight taken
out stays within a third (``GATE_MOST``); the mean is over the weight kept. The clip bounds
how far a liar pushes; the gate, where: one liar of four within the clip cost +0.3-0.5%
held-out loss in the simulation instead of clip 1's +1.8-2.8% (``bench/robust_mean.py``).
It does nothing in pairs (each is against the other, or neither, and one is half).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

import torch


CHUNK_ALIGN = 256  # elements: a multiple of every codec's block (int8: 256, fp4: 32)
HEAD_ROOM = 4096  # bytes of a frame that are not payload: envelope and message heads


def chunk_elements(max_frame_bytes: int) -> int:
    """Elements per message so that any codec's envelope fits in ``max_frame_bytes`` (4 bytes
    per element is the largest codec), a multiple of ``CHUNK_ALIGN``: a slice [s, e) is sent
    as chunks [s + k C, min(s + (k + 1) C, e)), and a chunk off that grid is refused (a sender
    of many tiny chunks would cost its receivers a quadratic time to check them)."""
    return (max_frame_bytes - HEAD_ROOM) // 4 // CHUNK_ALIGN * CHUNK_ALIGN


def chunk_spans(start: int, end: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(a + step, end)) for a in range(start, end, step)]


def on_grid(start: int, end: int, step: int, offset: int, numel: int) -> bool:
    """Whether [offset, offset + numel) is one of ``chunk_spans(start, end, step)``."""
    return (offset - start) % step == 0 and start <= offset < end and numel == min(step, end - offset)


def slice_bounds(numel: int, n: int, idle: Sequence[int] = ()) -> list[tuple[int, int]]:
    """[start, end) of each member's slice of a vector of ``numel`` elements. Members in
    ``idle`` (``GroupFormed.idle``) reduce nothing: theirs is empty, and the vector is cut
    among the others as it would be among that many members."""
    if n < 1 or numel < 0:
        raise ValueError(f"need n >= 1 and numel >= 0, got n={n} numel={numel}")
    idle = set(idle)
    if not idle <= set(range(n)) or len(idle) > max_idle(n):
        raise ValueError(f"idle members {sorted(idle)} are not up to {max_idle(n)} of {n} members")
    base, extra = divmod(numel, n - len(idle))
    out, start, k = [], 0, 0
    for j in range(n):
        if j in idle:
            out.append((start, start))
            continue
        end = start + base + (1 if k < extra else 0)
        out.append((start, end))
        start, k = end, k + 1
    return out


def max_idle(n: int) -> int:
    """How many members of a group of ``n`` its leader may leave without a slice to reduce
    (``GroupFormed.idle``: those that pushed nothing in its last round with them, ``peer.quiet``).
    A third at most, so a lying leader that idles honest members can at most bring its own share
    of the fragment from 1/n to 1/(n - n // 3); none in a group of two."""
    return n // 3


def bytes_sent(numel: int, n: int, encoded_size: Callable[[int], int], witness: bool = False,
               idle: Sequence[int] = ()) -> list[int]:
    """Bytes each member sends in one all-reduce of ``numel`` elements among ``n`` members:
    its n-1 foreign slices to their reducers, plus its reduced slice to the n-1 others, plus
    (``witness``, in groups that have them: ``witnessed``) its own slice to its witnesses."""
    bounds = slice_bounds(numel, n, idle)
    sizes = [encoded_size(e - s) for s, e in bounds]
    total = sum(sizes)
    extra = WITNESSES if witness and n > WITNESSES else 0
    return [(total - sizes[j]) + (n - 1 + extra) * sizes[j] for j in range(n)]


WITNESSES = 2
"""How many members each reducer sends its own slice to (``witnesses_of``). One is not enough:
the screen must allow any one member to lie, a witness too, and in the world in which the only
witness lies the reducer's term is unknown again (``bench/witness.py``)."""


def witnessed(n: int, clip: float) -> bool:
    """Whether a group of ``n`` with the run's ``clip`` has witnesses: only the screen of reduced
    parts uses them, it screens nothing without a clip (``screen_mean``), and a group of two
    has no member besides the reducer and the one the screen must allow to lie."""
    return bool(clip) and n > WITNESSES


def witnesses_of(part: int, n: int, group_id: bytes) -> tuple[int, ...]:
    """The members to whom reducer ``part`` sends its own slice, as it averages it (``PushSlice``
    frames of its own part), and who report that slice's norm and dot with the mean
    (``PartsHeld.witness``): members ``part + r`` (mod n) for ``WITNESSES`` distinct shifts r
    in [1, n - 1] drawn from the group's ID, so every member knows them, each member witnesses
    ``WITNESSES`` parts, and nobody chooses whom. () in a group of ``WITNESSES`` or fewer."""
    if n <= WITNESSES:
        return ()
    h = hashlib.blake2b(bytes(group_id), digest_size=16, person=b"swarm-witness").digest()
    shifts: list[int] = []
    for t in range(WITNESSES):
        free = [r for r in range(1, n) if r not in shifts]
        shifts.append(free[int.from_bytes(h[8 * t:8 * t + 8], "little") % len(free)])
    return tuple((part + r) % n for r in shifts)


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
    look too large, which has it audited before landing (``peer.audit.Audits.before_landing``:
    landed, and the under-report proven, ``protocol.evidence.false_norm``).

    The bound takes the clip as at least 2 (where it stood before the default became 1), for
    room: a refusal costs an audit, and the reducer our groups if it cannot be audited
    (``peer.node.syncs``); a reducer's larger mean within it is the screen's and the audits'
    to catch. The caller passes every such contributor's norm or does not bound the part
    (``peer.round_screen``: one whose norms it lacks may be anything up to the clip)."""
    if not clip or not others:
        return None
    return MEAN_SLACK * max(2.0, clip) * max(others)


def median_range(known: Sequence[float], unknown: int = 1) -> tuple[float, float]:
    """The lower median of the norms of a part's contributions (``clip_scales``'s), when we
    know ``known`` of them and ``unknown`` more may be anything: (lowest, highest) it can be
    (0 and inf when the unknown ones can decide it alone)."""
    o = sorted(known)
    t = (len(o) + unknown - 1) // 2  # the lower median's index among all the norms
    return (o[t - unknown] if t >= unknown else 0.0), (o[t] if t < len(o) else math.inf)


def mean_consistent(norm: float, error: float, terms: Sequence[tuple[float, float, float, float | None, float]],
                    lift: float = 1.0) -> bool:
    """Whether a reduced part ``m`` (decoded; ``norm`` = ||m||, ``error`` its encoding's
    ``Codec.error_bound``) can be its reducer's clipped weighted mean of its contributions.
    The mean is ``sum_i f_i s_i x_i`` (``s_i`` the clip scale in [lowest_i, highest_i]; ``f_i`` the
    factor, ``share_i`` = weight_i / the contributors' total weight), so

        ||m||^2 - sum_i f_i s_i <m, x_i>  =  <m, m - mean>,

    whose size is at most ``norm * error``. Each term is (share, lowest and highest scale,
    ``<m, x_i>`` or None when nobody we believe said it, a bound on its norm: ``|dot| <= norm x
    that``); the reducer's own slice is such a term too (with no dot, unless its witnesses
    vouched).

    Without the gate (``lift`` 1) every factor is its share. Under the direction gate the gated
    contributions' factors are 0 and the kept ones' ``weight / kept weight``, with at most
    ``GATE_MOST`` of the weight out; every such choice lies in the polytope ``0 <= f_i <= lift x
    share_i``, ``sum f_i = 1`` (``lift`` = 1 / (1 - GATE_MOST)), and the sum's range over it is a
    fractional knapsack: the lowest values per unit of factor first for its low end, the highest
    for its high end. A mean shrunk toward 0 or one term alone fits only as far as the terms
    nobody vouched for can make up the difference (in groups of 3-4 they often can:
    ``bench/witness.py --gate``). False when no factors and scales in their ranges make
    the two sides meet: a mean its inputs cannot give (negated, another vector, scaled up or
    down), caught inside the round from one number per member."""
    if not math.isfinite(error) or any(not math.isfinite(t[4]) for t in terms):
        return True
    spans = []  # per term: (most it may take of the factors' sum, lowest and highest value per unit)
    scale = norm * norm
    for share, lowest, highest, dot, its_norm in terms:
        if dot is None:
            a, b = -norm * its_norm, norm * its_norm
        else:
            a, b = sorted((lowest * dot, highest * dot))
        spans.append((lift * share, a, b))
        scale += lift * share * norm * its_norm

    def end(pick: int) -> float:  # the sum's low end (pick 1) or high end (pick 2)
        left, out = 1.0, []
        for room, *values in sorted(spans, key=lambda t: t[pick], reverse=pick == 2):
            take = room if lift <= 1.0 else min(room, left)  # without the gate, every factor is its share
            out.append(take * values[pick - 1])
            left -= take
        return math.fsum(out)

    low, high = end(1), end(2)
    allowed = norm * error * (1 + 1e-5) + 1e-5 * scale  # fp32 sums' rounding
    return low - allowed <= norm * norm <= high + allowed


def screen_mean(norm: float, error: float, clip: float, reducer_weight: float,
                others: Sequence[tuple[float, float | None, float | None]],
                reporters: Sequence[int] | None = None, vouched: Sequence[tuple[int, float, float]] = (),
                gate: bool = False, numel: int = 0) -> bool:
    """``mean_consistent`` for a part whose reducer has weight ``reducer_weight`` and whose
    other contributors reported ``others``: (weight, norm of its push as decoded or None, its
    dot with the mean or None), ``reporters`` saying which member reported each (default:
    entry i by member i). False only if the mean fits in no world with one liar besides the
    reducer: every member's reports true but one member's, whose norms and dots may be anything
    up to the clip. A contributor that did not report is anything up to the clip too. So one
    lying member cannot make an honest mean fail, whatever it reports or withholds.

    The reducer's own slice is anything up to the clip too (its own report is never used, so
    members that got it and members that did not, such as one that banned it, decide alike),
    unless its witnesses vouched for it: ``vouched`` holds (witness, norm, dot with the mean)
    of the slice the reducer sent each witness that saw it match the mean's commitment
    (``witnesses_of``). In a world whose liar is not that witness its term is then known; two
    believed witnesses that disagree make the world impossible (one of them lies).

    True (nothing to say) for a plain mean (``clip`` 0: a slice may be anything), a part with
    no other contributor and no vouch (with two vouches, a reducer that counted only itself
    must return its own slice), weights that do not sum to a positive total, or a group too
    small for the clip to bound a liar.

    Under the direction gate (``gate``, among three contributions or more) any contribution
    may count for nothing and the kept ones' shares grow by up to 1 / (1 - ``GATE_MOST``), while
    the factors still sum to 1 (the mean is over the weight kept): ``mean_consistent``'s
    knapsack. A first version let each factor be anywhere from 0 to that alone, and a mean
    shrunk x0.2, or the reducer's own slice alone, passed every screen.

    ``numel``: the part's length, for the reducer's float32 rounding below the normal range
    (absolute, 2^-149 a step, where the relative room does not reach: an honest fp32 mean of
    pushes that were all subnormal was refused)."""
    error += 2.0 * (len(others) + 1) * 2.0 ** -149 * math.sqrt(numel)
    total = reducer_weight + math.fsum(w for w, _, _ in others)
    lift = 1.0 / (1.0 - GATE_MOST - GATE_SLACK) if gate and len(others) >= 2 else 1.0
    if not clip or not (others or vouched) or not (total > 0 and math.isfinite(total)):
        return True
    who = list(range(len(others))) if reporters is None else list(reporters)
    if len(who) != len(others):
        raise ValueError("one reporter per entry")
    silent = {i for i, (_, n, _) in enumerate(others) if n is None}

    def fits(liar: int | None) -> bool:
        unknown = silent | {i for i in range(len(others)) if who[i] == liar}
        believed = [(n, d) for w, n, d in vouched if w != liar]
        if any(not (math.isclose(n, believed[0][0], rel_tol=1e-9)
                    and math.isclose(d, believed[0][1], rel_tol=1e-9, abs_tol=1e-9 * norm * max(n, believed[0][0])))
               for n, d in believed[1:]):
            return False  # two members that do not lie in this world said different things (beyond the
            # rounding of a float64 dot summed in another order)
        known = [n for i, (_, n, _) in enumerate(others) if i not in unknown] + [n for n, _ in believed[:1]]
        low, high = median_range(known, len(unknown) + (0 if believed else 1))
        if not math.isfinite(high):
            return True  # the unknown norms may set the clip: nothing bounds them
        cap = clip * high  # no contribution's clipped norm exceeds it
        # a known term's scale lies between its clip scales at the lowest and highest median
        # (``clip_scale`` does not decrease with the median): a slice far beyond the honest
        # norms counts for little or nothing, however far it points along the mean
        terms = [(w / total, 0.0, 1.0, None, cap) if i in unknown else
                 (w / total, clip_scale(n, low, clip), clip_scale(n, high, clip), dot, n)
                 for i, (w, n, dot) in enumerate(others)]
        if believed:
            n, d = believed[0]
            terms.append((reducer_weight / total, clip_scale(n, low, clip), clip_scale(n, high, clip), d, n))
        else:  # the reducer's own slice: its word, up to the clip
            terms.append((reducer_weight / total, 0.0, 1.0, None, cap))
        return mean_consistent(norm, error, terms, lift)

    speaking = sorted({who[i] for i in range(len(others)) if i not in silent} | {w for w, _, _ in vouched})
    return any(fits(r) for r in speaking) if speaking else fits(None)


FAR = 25.0
"""A contribution beyond ``FAR x max(1, clip)`` times the lower median norm (25x at the default
clip of 1, 50x at 2: the same for a run made before that default) is
no honest pseudo-gradient of the round, so its direction is not kept either: its scale falls
linearly to 0 at twice that (``clip_scale``). Honest norms of one round stay within a few
percent of each other, but a member that managed few of its inner steps (a slow follower hands over what
it did) pushes a far smaller one, and the lower median of a group of two or four may be its:
a first version tapered from 10x and gave a fast member 20x the slow one's norm no weight at
all (a review). x1000 and 1e30 are far beyond either."""


def clip_scale(norm: float, median: float, clip: float) -> float:
    """The factor (at most 1) a contribution of ``norm`` gets where the lower median of the
    contributions' norms is ``median``: 1 up to ``clip x median``, then what brings it down to
    that, and beyond ``FAR x max(1, clip) x median`` less again, linearly to 0 at twice that (x1000
    or values near 1e30 count for nothing rather than as a slice of the clip's norm pointing
    wherever the liar chose: a constant vector of 1e30 clipped to an honest norm cost +22%
    held-out loss in ``bench/quality.py``'s liar rows). Continuous and non-decreasing in
    ``median``, so a screen that knows the median only within a range takes its lowest end
    (``screen_mean``), and an auditor's float rounding moves a mean by a rounding only."""
    bound = clip * median
    if norm <= bound:
        return 1.0
    if bound <= 0.0:
        return 0.0
    far = FAR * max(1.0, clip) * median
    return bound / norm * min(1.0, max(0.0, 2.0 - norm / far))


def lower_median(norms: Sequence[float]) -> float:
    """The lower median of ``norms`` (not empty): the one at index (n - 1) // 2 in order."""
    return sorted(norms)[(len(norms) - 1) // 2]


def clip_scales(norms: Sequence[float], clip: float) -> list[float]:
    """Per contribution, its ``clip_scale`` under the lower median of ``norms``; all 1.0 when
    ``clip`` is 0 (the plain mean) or for one norm."""
    if not clip or len(norms) < 2:
        return [1.0] * len(norms)
    median = lower_median(norms)
    return [clip_scale(n, median, clip) for n in norms]


GATE_MOST = 1.0 / 3.0
"""The direction gate (``protocol.gate``) takes out at most this share of a part's weight (one
of three equal members, give or take ``GATE_SLACK``). The kept terms' shares grow by at most
1 / (1 - this), and the screen must allow them that room (``screen_mean``): at a half (x2) a
negated mean passed the screen with two witnesses in 36 of 36 groups of 3 (cosine 0.3) and 10
of 48 of 4; at a third (x1.5), with the factors summing to 1 (``mean_consistent``), in none
(without the gate, none: ``bench/witness.py --clip 1 [--gate]``)."""
GATE_SLACK = 1e-9
"""How far over ``GATE_MOST`` (relative to the part's weight) the gated weight may be: the
reducer's and an auditor's sums of the same shares differ by a rounding, and one of three
equal members is at ``GATE_MOST`` exactly. An audit takes either decision for a set whose
weight is within 1e-12 of this (``protocol.gate.Gate.possible``)."""
