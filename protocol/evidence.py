"""Proof that a peer lied: a frame it signed that no honest peer sends, whatever its group.

A signature proves who sent a message, not that it is honest; but a signed ``PushSlice`` or
``SliceAveraged`` whose values are NaN or infinite, whose block scales or layout the codec
refuses, or whose shape is not a flat float32 slice, proves to *anyone* that its signer sent
something no honest client sends. Such a frame is kept as evidence (``peer.bans``), and anyone
can check it again with ``offence`` alone. A frame that is wrong only for the round it was sent
in (a weight or an offset that does not match the group, a slice sent late or short) is
dropped from that round, but proves nothing to others: it is never evidence, so an honest peer
that is slow, or that saw another view of a group, is never banned.

Equivocation (``equivocation``): two ``SliceAveraged`` frames signed by one reducer for the
same part of the same group whose element ranges overlap but which differ in what a member's
digest of the part covers (values, or contributors). An honest reducer computes a part once and sends the same signed
frames to every member (and the same again when it resends), so two such frames prove that it
sent different means to different members.

A contradicted own slice (``own_contradiction``): a reducer's ``SliceAveraged`` chunk commits
to the payload digest of its own slice's chunk over the same elements (``own``), and the
reducer sends that chunk, signed, to its witnesses (``protocol.butterfly.witnesses_of``) as a
``PushSlice`` of its own part. An honest reducer chunks both alike and sends each witness the
chunk it committed to; an own chunk over elements of a mean chunk that names another digest,
or cut at other offsets, proves that it told its witnesses one slice and averaged (or claimed)
another.

A false norm (``false_norm``): a member's report (``PartsHeld``) says how large its slice of each
part was, and the screens of the others bound a part's mean by those norms. A report that
says a push was smaller than the pushes it signed for that part show (the least norm of what
they encode, since the norm of its own part is of the raw values) makes an honest mean look
too large to one member: proof of a lie, found when an audit fetches the signed pushes.
``proves`` checks any evidence: one frame or two (or an audit's frames, or a report and
pushes). Such a proof holds the report and the fewest chunks that beat it.

Contradicting finals (``contradicting_finals``): a member that finishes a round tells every
other member, in a final report (``PartsHeld`` with ``final``), which parts it landed. It
lands once per round and sends that one tuple to every member (and again, the same, in answer
to a late report), so two finals it signed for one group that name different parts prove that
it told members different things about what it landed (members relay the finals they got, so
that such a pair meets: ``peer.allreduce_send``).

A proof is handed on as one ``Evidence`` frame, or, when it does not fit one (an audit's
proof of a large part), as ``EvidencePiece`` frames, each a run of its frames, with
``proof_digest`` of the whole so that the receiver knows when it has all of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from protocol.audit import wrong_mean
from protocol.codecs import get_codec
from protocol.envelope import Verified, verify
from protocol.errors import ProtocolError, RemoteProtocolError
from protocol.messages import MAX_FRAME_BYTES, digest
from protocol.messages_swarm import PartsHeld, PushSlice, SliceAveraged

__all__ = ["NORM_ROOM", "contradicting_finals", "equivocation", "false_norm", "floor_squares", "offence",
           "own_contradiction", "proof_digest", "proves"]

NORM_ROOM = 1e-6
"""Relative room ``false_norm`` allows a reported norm for the float64 sums' order (an honest
report's norm and a checker's differ by ~1e-15 relative)."""


def proof_digest(frames: Sequence[bytes]) -> bytes:
    """The digest of a proof's frames, in order (``EvidencePiece.whole``)."""
    return digest(*(digest(f) for f in frames))


def offence(frame: bytes, run_id: bytes) -> tuple[bytes, str] | None:
    """(the signer's Ed25519 public key, what is wrong) if ``frame`` is a ``PushSlice`` or
    ``SliceAveraged`` of run ``run_id``, validly signed, that fails a check needing nothing but
    the frame itself; None for anything else (a bad signature proves nothing about anyone)."""
    try:
        v = verify(frame, expect=(PushSlice, SliceAveraged), run_id=run_id, max_size=MAX_FRAME_BYTES)
    except RemoteProtocolError:
        return None
    msg = v.message
    assert isinstance(msg, (PushSlice, SliceAveraged))
    try:
        if msg.dtype != "float32" or tuple(msg.shape) != (msg.numel,) or msg.numel == 0:
            raise RemoteProtocolError(f"shape {tuple(msg.shape)} / dtype {msg.dtype} is not a flat float32 slice")
        get_codec(msg.codec).decode(msg.payload, msg.numel)  # layout, block scales, finiteness
    except ProtocolError as e:
        return v.signer, f"{type(msg).__name__}: {e}"[:200]
    return None


def equivocation(frame_a: bytes, frame_b: bytes, run_id: bytes) -> tuple[bytes, str] | None:
    """(the reducer's key, what it did) if the two frames are ``SliceAveraged`` of run
    ``run_id``, both validly signed by one key, for the same fragment, round, group and part,
    over overlapping element ranges, and not the same mean (other contributors, or other
    values: what a member's digest of the part covers); None otherwise."""
    pair = _overlapping(frame_a, SliceAveraged, frame_b, SliceAveraged, run_id)
    if pair is None:
        return None
    a, b = pair
    ma = a.message
    assert isinstance(ma, SliceAveraged)
    if _what(a) == _what(b):
        return None  # the same mean (a resend): honest
    return a.signer, (f"SliceAveraged: two different means of part {ma.part} of one group "
                      f"(round {ma.round}, fragment {ma.fragment}) sent to different members")


def contradicting_finals(frame_a: bytes, frame_b: bytes, run_id: bytes) -> tuple[bytes, str] | None:
    """(the member's key, what it did) if the two frames are final ``PartsHeld`` of run
    ``run_id``, both validly signed by one key, for the same fragment, round and group, naming
    different parts landed; None otherwise (the same final twice is a resend)."""
    try:
        a = verify(frame_a, expect=(PartsHeld,), run_id=run_id, max_size=MAX_FRAME_BYTES)
        b = verify(frame_b, expect=(PartsHeld,), run_id=run_id, max_size=MAX_FRAME_BYTES)
    except RemoteProtocolError:
        return None
    ma, mb = a.message, b.message
    assert isinstance(ma, PartsHeld) and isinstance(mb, PartsHeld)
    if a.signer != b.signer or not (ma.final and mb.final):
        return None
    if (ma.fragment, ma.round, bytes(ma.group_id)) != (mb.fragment, mb.round, bytes(mb.group_id)):
        return None
    if tuple(bytes(d) for d in ma.digests) == tuple(bytes(d) for d in mb.digests):
        return None
    return a.signer, (f"PartsHeld: two different finals (the parts it landed) for one group (round {ma.round}, "
                      f"fragment {ma.fragment}) sent to different members")


def own_contradiction(mean_frame: bytes, own_frame: bytes, run_id: bytes) -> tuple[bytes, str] | None:
    """(the reducer's key, what it did) if ``mean_frame`` is a ``SliceAveraged`` and ``own_frame``
    a ``PushSlice`` of the same part of the same group (run ``run_id``), both validly signed by
    the reducer of that part, over overlapping elements, and the push is not the own chunk the
    mean commits to (other offsets, or another payload digest than ``own``); None otherwise."""
    pair = _overlapping(mean_frame, SliceAveraged, own_frame, PushSlice, run_id)
    if pair is None:
        return None
    mean, own = pair
    m, p = mean.message, own.message
    assert isinstance(m, SliceAveraged) and isinstance(p, PushSlice)
    if (m.offset, m.numel) == (p.offset, p.numel) and bytes(m.own) == bytes(own.payload_digest):
        return None  # the chunk it committed to
    return mean.signer, (f"PushSlice: its own slice of part {m.part} (round {m.round}, fragment {m.fragment}) sent "
                         f"to its witness is not the one its mean commits to")


def floor_squares(push: PushSlice) -> float:
    """The least squared norm the slice that ``push`` encodes can have had: element by element,
    ``max(0, |decoded| - its rounding)`` (``Codec.element_bounds``; a value the codec saturated
    was larger still), so for an honest member's push it is at most its report's norm, whether
    that norm is of the push as decoded (another's part) or of the raw values (its own).
    Raises ``ProtocolError`` for a payload the codec refuses."""
    codec = get_codec(push.codec)
    floor = codec.decode(push.payload, push.numel).double().abs_().sub_(codec.element_bounds(push.payload, push.numel))
    return float(torch.sum(floor.clamp_(min=0.0) ** 2))


def false_norm(frames: Sequence[bytes], run_id: bytes) -> tuple[bytes, str] | None:
    """(the reporter's key, what it did) if ``frames[0]`` is a ``PartsHeld`` report (not a
    final) of run ``run_id`` and the rest are ``PushSlice`` frames signed by the same key, of one
    part of the same group, over disjoint elements, whose least norm (``floor_squares``: the
    norm of one's own part is of the raw values) is larger than the report says that slice
    was. A subset of a push's chunks has at most the whole push's norm, so an honest member's
    report is never contradicted by any of its pushes. None otherwise."""
    try:
        report = verify(frames[0], expect=(PartsHeld,), run_id=run_id, max_size=MAX_FRAME_BYTES)
        pushes = [verify(f, expect=(PushSlice,), run_id=run_id, max_size=MAX_FRAME_BYTES) for f in frames[1:]]
    except RemoteProtocolError:
        return None
    rep = report.message
    assert isinstance(rep, PartsHeld)
    msgs = sorted((v.message for v in pushes), key=lambda m: m.offset)  # type: ignore[attr-defined]
    if rep.final or not msgs or any(v.signer != report.signer for v in pushes):
        return None
    part = msgs[0].part
    if part >= len(rep.norms) or any((m.fragment, m.round, bytes(m.group_id), m.part)
                                     != (rep.fragment, rep.round, bytes(rep.group_id), part) for m in msgs):
        return None
    if any(a.offset + a.numel > b.offset for a, b in zip(msgs, msgs[1:])):
        return None  # overlapping chunks (two pushes of one chunk): not one push's norm
    try:
        shown = math.sqrt(math.fsum(floor_squares(m) for m in msgs))
    except ProtocolError:
        return None
    said = rep.norms[part]
    if not math.isfinite(shown) or shown <= said * (1 + NORM_ROOM):
        return None
    return report.signer, (f"PartsHeld: reported the norm of its slice of part {part} (round {rep.round}, "
                           f"fragment {rep.fragment}) as {said:.4g}; its signed push of it shows at least {shown:.4g}")


def proves(frames: Sequence[bytes], run_id: bytes, clip: float = 0.0, gate: bool = False) -> tuple[bytes, str] | None:
    """What ``frames`` prove, if anything: one frame through ``offence``, a report and pushes
    through ``false_norm``, two through ``equivocation`` or ``contradicting_finals`` (or, failing that, an audit), more
    through ``protocol.audit.wrong_mean``
    (a part's mean and the inputs its reducer showed; ``clip``, ``gate``: the run's sync.clip
    and sync.gate).
    -> (the liar's key, what it did) or None."""
    if len(frames) == 1:
        return offence(frames[0], run_id)
    if len(frames) >= 2 and (proven := false_norm(frames, run_id)) is not None:
        return proven
    if len(frames) == 2 and (proven := equivocation(frames[0], frames[1], run_id)) is not None:
        return proven
    if len(frames) == 2 and (proven := contradicting_finals(frames[0], frames[1], run_id)) is not None:
        return proven
    if len(frames) == 2 and (proven := own_contradiction(frames[0], frames[1], run_id)) is not None:
        return proven
    if len(frames) >= 2:
        return wrong_mean(frames, run_id, clip, gate)
    return None


def _overlapping(frame_a: bytes, kind_a: type, frame_b: bytes, kind_b: type,
                 run_id: bytes) -> tuple[Verified, Verified] | None:
    """The two frames verified (run ``run_id``), if they are of the kinds asked, signed by one
    key, of the same part of one group, and over overlapping elements; None otherwise (then
    both may be honest)."""
    try:
        a = verify(frame_a, expect=(kind_a,), run_id=run_id, max_size=MAX_FRAME_BYTES)
        b = verify(frame_b, expect=(kind_b,), run_id=run_id, max_size=MAX_FRAME_BYTES)
    except RemoteProtocolError:
        return None
    if a.signer != b.signer or _where(a) != _where(b):
        return None
    ma, mb = a.message, b.message
    if not (ma.offset < mb.offset + mb.numel and mb.offset < ma.offset + ma.numel):  # type: ignore[attr-defined]
        return None
    return a, b


def _where(v: Verified) -> tuple:
    m = v.message
    return (m.fragment, m.round, bytes(m.group_id), m.part)  # type: ignore[attr-defined]


def _what(v: Verified) -> tuple:
    m = v.message
    # what a member's digest of the part covers (peer.allreduce_round.part_digest); the other
    # fields are fixed by the group (codec, a flat float32 slice) or by the contributors (weight)
    return (m.offset, m.numel, tuple(m.contributors), bytes(m.own), v.payload_digest)  # type: ignore[attr-defined]
