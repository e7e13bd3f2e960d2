"""Audit of a reducer: does the mean it signed follow from the inputs it committed to?

A reducer's ``SliceAveraged`` carries ``inputs``, a digest of what it averaged: for every
contributor, its public key, its weight and the chunks of its slice (offset, size, payload
digest), the reducer's own slice's as well: it averages its own slice encoded with the part's
codec, in ``PushSlice`` frames of its own part signed by itself, the ones it sends its
witnesses in groups that have them (``protocol.butterfly.witnesses_of``) (``inputs_digest``). Everyone who holds the part sees
the same commitment. A member that audits the part asks the reducer for those inputs
(``AuditRequest``); the reducer answers with the contributors' ``PushSlice`` frames, signed
by them, and its own.

``check`` recomputes the mean from the inputs, as ``protocol.butterfly`` says a reducer
computes it (each contribution scaled to ``clip`` x the lower median norm, weighted by its
share), and compares with what the reducer signed, decoded:

- ``OK``: the mean follows from the inputs. Each of its values lies within its own code's
  rounding (``Codec.element_bounds``) of the recomputed mean, and each block scale within its
  rounding of the recomputed block's (``Codec.block_scales``); what lies beyond those (an
  honest reducer's only by the order of its float additions) is within ``TOLERANCE`` of the
  contributions' scale (``_beyond_rounding``). Encoding the recomputed mean again and
  comparing under ``TOLERANCE`` alone is not a check: a last-bit difference in a block's largest
  value can move the block's scale by one step and a value across the midpoint between two
  codes, a whole code step (an honest fp4 mean was found "1.12 away" with a bound of about
  0.5 that way);
- ``WRONG``: the inputs match the commitment and the mean does not follow from them. The
  frames prove it to anyone (``peer.bans`` keeps them): the reducer signed both, and the
  pushes are signed by their senders, so nobody else can make such a set. A contributor
  that signs two different pushes cannot frame an honest reducer either: only the push the
  reducer committed to matches the commitment;
- ``UNPROVEN``: the frames do not match the commitment, or are incomplete: the reducer did not
  show its inputs, which proves nothing to others (the auditor stops grouping with it); or,
  under the direction gate, more outcomes of the gate are within its rounding than an audit
  tries (``protocol.gate.Gate.possible``: pushes placed on its line on purpose), and the mean
  is not checked (the auditor suspends the reducer, as for an answer cut short).

What an audit bounds: the reducer's own slice is its word, so a reducer that lies
consistently can still move its part as far as any contributor can (``clip`` x the lower
median norm x its weight share); no further. An audit costs the auditor about
``n x`` the part's encoded size.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import msgpack
import torch

from protocol.butterfly import clip_scales, slice_norm
from protocol.codecs import get_codec
from protocol.envelope import Verified, verify
from protocol.gate import GATE_CHOICES, Gate, gated_factors, gates, gram
from protocol.errors import ProtocolError, RemoteProtocolError
from protocol.messages import MAX_FRAME_BYTES, digest
from protocol.messages_swarm import PushSlice, SliceAveraged

__all__ = ["OK", "TOLERANCE", "UNPROVEN", "WRONG", "check", "contribution_digest", "inputs_digest",
           "wrong_mean"]

OK, WRONG, UNPROVEN = "ok", "wrong", "unproven"
NOT_COMMITTED = "the inputs shown are not the ones the reducer committed to"
"""What an ``UNPROVEN`` verdict says when the inputs shown (one set per contributor) are not the
ones the mean commits to. An answer cut short says it too; one that covered the whole part
(``peer.audit`` knows) is no proof others can check, but no crash does that, and the auditor
shuts the reducer out for good."""
TOLERANCE = 0.02
"""A signed mean is wrong when what lies beyond its rounding (``_beyond_rounding``) is more
than this x the sum of the weighted, clipped contributions' norms. An honest mean is within
float rounding (~1e-7) of the recomputed one before it is encoded."""


def contribution_digest(key: bytes, weight: float, chunks: Iterable[tuple[int, int, bytes]]) -> bytes:
    """One contributor's share of a commitment: its key, its weight, and its chunks
    (offset, numel, payload digest) in offset order."""
    ordered = [[o, n, bytes(d)] for o, n, d in sorted(chunks)]
    return digest(msgpack.packb([bytes(key), struct.pack("<d", weight), ordered], use_bin_type=True))


def inputs_digest(contributions: Iterable[bytes]) -> bytes:
    """A reducer's commitment: the digest of its contributors' ``contribution_digest`` s, sorted."""
    return digest(*sorted(bytes(c) for c in contributions))


def check(mean_frames: Sequence[bytes], input_frames: Sequence[bytes], run_id: bytes,
          clip: float, gate: bool = False) -> tuple[str, bytes | None, str]:
    """-> (``OK`` | ``WRONG`` | ``UNPROVEN``, the reducer's key or None, what was found); see the
    module docstring. Never raises on bad frames: they prove nothing (``UNPROVEN``)."""
    try:
        means = [verify(f, expect=(SliceAveraged,), run_id=run_id, max_size=MAX_FRAME_BYTES) for f in mean_frames]
    except RemoteProtocolError as e:
        return UNPROVEN, None, f"a mean frame does not verify: {e}"
    if not means:
        return UNPROVEN, None, "no mean"
    reducer = means[0].signer
    try:
        return _check(means, input_frames, run_id, clip, gate)
    except (ProtocolError, ValueError) as e:
        return UNPROVEN, reducer, str(e)[:200]


def _check(means: list[Verified], input_frames: Sequence[bytes], run_id: bytes,
           clip: float, gate: bool) -> tuple[str, bytes | None, str]:
    head = means[0].message
    assert isinstance(head, SliceAveraged)
    reducer = means[0].signer
    where = (head.fragment, head.round, bytes(head.group_id), head.part)
    for v in means:
        m = v.message
        assert isinstance(m, SliceAveraged)
        if v.signer != reducer or _where(m) != where or m.contributors != head.contributors \
                or m.inputs != head.inputs or m.codec != head.codec:
            raise ValueError("the mean frames are not one reducer's chunks of one part")
    start, end, mean_chunks = _span([(v.message.offset, v.message.numel, v.message.payload) for v in means])
    codec = get_codec(head.codec)

    by_signer: dict[bytes, list[tuple[int, int, bytes, bytes]]] = {}
    weights: dict[bytes, float] = {}
    for f in input_frames:
        v = verify(f, expect=(PushSlice,), run_id=run_id, max_size=MAX_FRAME_BYTES)
        m = v.message
        assert isinstance(m, PushSlice)
        if _where(m) != where:
            raise ValueError("an input frame is for another group or part")
        if m.codec != head.codec or m.dtype != "float32" \
                or tuple(m.shape) != (m.numel,):
            raise ValueError(f"an input frame has codec {m.codec} / shape {tuple(m.shape)}")
        if weights.setdefault(v.signer, m.weight) != m.weight:
            raise ValueError("one contributor's input frames carry different weights")
        by_signer.setdefault(v.signer, []).append((m.offset, m.numel, bytes(v.payload_digest), m.payload))
    if reducer not in by_signer or len(by_signer) != len(head.contributors):
        raise ValueError(f"inputs of {len(by_signer)} contributors for a mean of {len(head.contributors)}")
    commitment = inputs_digest(contribution_digest(k, weights[k], [(o, n, d) for o, n, d, _ in chunks])
                               for k, chunks in by_signer.items())
    if commitment != bytes(head.inputs):
        return UNPROVEN, reducer, NOT_COMMITTED

    keys = sorted(by_signer)
    values = []
    for k in keys:
        s, e, chunks = _span([(o, n, p) for o, n, _, p in by_signer[k]])
        if (s, e) != (start, end):
            raise ValueError("an input does not cover the part")
        values.append(torch.cat([codec.decode(p, n) for _, n, p in chunks]))  # raises on non-finite values
    norms = [slice_norm(x) for x in values]
    scales = clip_scales(norms, clip)
    total = math.fsum(weights[k] for k in keys)
    if not total > 0:
        raise ValueError("the contributors' weights do not sum to a positive total")
    if not math.isclose(total, head.weight, rel_tol=1e-9, abs_tol=1e-12):
        return WRONG, reducer, (f"SliceAveraged: a mean of part {head.part} (round {head.round}, fragment "
                                f"{head.fragment}) over a weight of {head.weight:g}, from inputs weighing {total:g}")
    shares = [weights[k] / total for k in keys]
    if not gates(len(keys), clip, gate):
        ranked: list[tuple[float, list[float]]] = [(0.0, [s * c for s, c in zip(shares, scales)])]
        lower = None
    else:  # as protocol.gate.robust_factors
        mean = torch.cat([codec.decode(p, n) for _, n, p in mean_chunks])
        g = gram(_blocks(values + [mean]))  # the slices' and the mean's, in float64
        choices = Gate([w * s for w, s in zip(shares, scales)], shares, g[:-1, :-1]).possible()
        if choices is None:  # pushes placed on the gate's line: no honest push is; the reducer is not cleared
            return UNPROVEN, reducer, (f"over {GATE_CHOICES} outcomes of the direction gate within its rounding "
                                       "(pushes placed on its line): the mean is not checked")
        ranked, lower = _ranked(choices, g, scales, shares, norms, codec, mean_chunks)
    best, bound_only = math.inf, False
    for far, ws in ranked:  # each gate decision an honest reducer may have taken, nearest first
        scale_sum = math.fsum(w * n for w, n in zip(ws, norms))
        if lower is not None and (off := lower(far, scale_sum)) > TOLERANCE * scale_sum + 1e-30:
            best, bound_only = min((best, bound_only), (off, True))  # it cannot pass (``_ranked``): not recomputed
            continue
        acc = torch.zeros(end - start, dtype=torch.float32)
        for x, w in zip(values, ws):
            acc.add_(x, alpha=w)
        off = _beyond_rounding(codec, mean_chunks, start, acc)
        if off <= TOLERANCE * scale_sum + 1e-30:
            return OK, reducer, f"within {off:.3g}"
        best, bound_only = min((best, bound_only), (off, False))
    return WRONG, reducer, (f"SliceAveraged: a mean of part {head.part} (round {head.round}, fragment "
                            f"{head.fragment}) {'at least ' if bound_only else ''}{best:.3g} away from the one its "
                            "committed inputs give")


BLOCK = 1 << 20
"""Elements per block of the audit's Gram matrix (``_blocks``): float64 copies of this many
elements of each slice at a time, not of the whole part."""


def _blocks(vectors: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
    n = vectors[0].numel()
    return ([v[a:a + BLOCK] for v in vectors] for a in range(0, n, BLOCK))


def _ranked(choices: Iterable[frozenset[int]], g: torch.Tensor, scales: Sequence[float], shares: Sequence[float],
            norms: Sequence[float], codec: Any, mean_chunks: list[tuple[int, int, bytes]]):
    """The gate's possible sets, nearest first by the distance of the mean from each set's mean
    (from the Gram matrix ``g`` of the slices and the mean, last): an honest mean passes at
    its first. -> ([(distance, each contribution's weight in that set's mean)], ``lower``: (distance, that set's scale sum) -> a lower
    bound of what ``_beyond_rounding`` would find for it, or None for a codec that clamps).

    The bound: the excess beyond the rounding is at least the distance of the decoded mean from
    the float32 recomputation less the norm of the elements' bounds (a triangle inequality per
    element), and the recomputation lies within a float rounding of the exact set's mean. The
    Gram matrix's float64 sums over the part are off by at most about 1e-8 of its terms'
    scale, so the distance by about 1e-4 of it (a square root); ``lower`` takes 1e-3 of the
    scale off, and half of what is left, so a set is skipped
    only when its distance is twice what could still pass. A codec whose encoder clamps
    (``max_value``) can bring a far value within reach: no skipping there."""
    n = len(norms)
    mean_sq, dots = float(g[n, n]), g[:n, n]
    ranked = []
    for gated in choices:
        ws = [s * f for s, f in zip(shares, gated_factors(scales, shares, gated))]
        c = torch.tensor(ws, dtype=torch.float64)
        far = math.sqrt(max(0.0, mean_sq - 2.0 * float(c @ dots) + float(c @ (g[:n, :n] @ c))))
        ranked.append((far, sorted(gated), ws))
    ranked.sort(key=lambda t: (t[0], t[1]))
    out = [(far, ws) for far, _, ws in ranked]
    if math.isfinite(getattr(codec, "max_value", math.inf)):
        return out, None
    rounding = math.sqrt(math.fsum(float(codec.element_bounds(p, k).square().sum()) for _, k, p in mean_chunks))

    def lower(far: float, scale_sum: float) -> float:
        return 0.5 * (far - 1e-3 * (math.sqrt(mean_sq) + scale_sum)) - rounding

    return out, lower


def _beyond_rounding(codec: Any, chunks: list[tuple[int, int, bytes]], start: int, acc: torch.Tensor) -> float:
    """How far the signed mean (``chunks``, from ``start``) lies from ``acc`` beyond what its
    encoding's rounding allows: per element, the excess of the difference over the element's
    own bound (``Codec.element_bounds``), against ``acc`` clamped to the codec's range as an
    encoder clamps; per block of a codec with block scales, the excess of ``divisor x scale``
    over the recomputed block's absmax beyond the scale's rounding (a block at the largest
    scale is left out: an encoder clamps there). -> the L2 norm of all the excesses. An honest
    mean's excesses are each at most its float difference from ``acc``. One budget over the
    whole part (the codec's ``error_bound``) let an fp4 mean x1.25, or one with its 4 largest
    values negated, pass; and a raw codec's bound is infinite once a value saturates, which let
    any fp16 mean with one value at the range's end pass (a review's repros)."""
    top = getattr(codec, "max_value", math.inf)
    total = 0.0
    for o, n, p in chunks:
        target = acc[o - start:o - start + n].double().clamp(-top, top)
        total += float(((codec.decode(p, n).double() - target).abs_() - codec.element_bounds(p, n))
                       .clamp_(min=0).square_().sum())
        blocks = codec.block_scales(p, n)
        if blocks is not None:
            scales, size, divisor, rel, largest = blocks
            pad = (-n) % size
            amax = torch.nn.functional.pad(target.abs(), (0, pad)).view(-1, size).amax(1)
            excess = ((scales * divisor - amax).abs_() - scales * divisor * rel - divisor * 1e-35).clamp_(min=0)
            total += float(excess[scales < largest].square_().sum())
    return math.sqrt(total)


def wrong_mean(frames: Sequence[bytes], run_id: bytes, clip: float, gate: bool = False) -> tuple[bytes, str] | None:
    """(the reducer's key, what it did) if ``frames`` (a part's ``SliceAveraged`` frames and the
    inputs its reducer showed, in any order) prove that it signed a wrong mean; else None."""
    means, inputs = [], []
    for f in frames:
        try:
            kind = verify(f, expect=(SliceAveraged, PushSlice), run_id=run_id, max_size=MAX_FRAME_BYTES).message
        except RemoteProtocolError:
            return None
        (means if isinstance(kind, SliceAveraged) else inputs).append(f)
    verdict, key, why = check(means, inputs, run_id, clip, gate)
    return (key, why) if verdict == WRONG and key is not None else None


def _where(m: PushSlice | SliceAveraged) -> tuple:
    return (m.fragment, m.round, bytes(m.group_id), m.part)


def _span(chunks: list[tuple[int, int, bytes]]) -> tuple[int, int, list[tuple[int, int, bytes]]]:
    """Chunks (offset, numel, payload) in offset order, checked to tile [start, end) once."""
    ordered = sorted(chunks, key=lambda c: c[0])
    start = end = ordered[0][0]
    for o, n, _ in ordered:
        if o != end or n <= 0:
            raise ValueError("the chunks leave a gap or overlap")
        end = o + n
    return start, end, ordered
