"""Messages between peers of a run: DHT records, averaging, state sync.

All of them travel inside a signed envelope (``protocol.envelope``). Requests are imperative
(``JoinGroup``, ``PushSlice``, ``RequestStateChunk``), records and replies are nouns or past
tense (``Heartbeat``, ``GroupFormed``, ``SliceAveraged``). Fields named ``run_id``, ``round``,
``fragment`` and ``group_id`` are bound by the signature (see ``Message.context``).

Averaging one fragment for one round (see protocol.butterfly):

1. every ready peer sends ``JoinGroup``; the group's members learn their order from
   ``GroupFormed`` (member j reduces slice j of the fragment's flat vector);
2. each member sends ``PushSlice`` with its encoded slice j to member j;
3. member j sends ``SliceAveraged``, the weighted mean of what it received, to the others;
4. every member tells the others which reduced parts it holds (``PartsHeld``, by digest); a
   member that holds a part another lacks forwards it the reducer's signed ``SliceAveraged``
   frames, so the members that finish the round hold the same parts.

State sync: a joiner picks the ``StateIndex`` digest that most ``Heartbeat``\\ s vouch for,
fetches that index with ``RequestStateIndex``, then its chunks from several donors with
``RequestStateChunk``; each ``StateChunk`` payload must hash to the index's entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated

from protocol.config import CODEC_NAMES
from protocol.messages import (
    DIGEST_BYTES, KEY_BYTES, MAX_FRAGMENTS, MAX_GROUP_SIZE, MAX_HEAD_BYTES, MAX_STATE_CHUNKS, U32, U64, Bool,
    Bytes, Digest, FieldError, Float, GroupId, Int, Line, MaybeDigest, Message, Multiaddrs, Payload, Rate,
    RunId, Seconds, Seq, Str, Tag, UnixTime, Weight, message,
)

PEER_STATES = ("joining", "syncing", "training", "averaging", "paused", "finishing", "finished", "leaving")
"""What a peer is doing, as shown in heartbeats and on the dashboard. ``finished``: done training, it
compares its final copy with the other finishers' before it goes (and its last heartbeat says so)."""
DTYPES = ("float32", "float16", "bfloat16")
"""Element types a decoded slice is applied to."""
REJECT_CODES = ("unknown_run", "wrong_round", "too_late", "group_full", "busy", "not_found",
                "bad_request", "shutting_down")

Fragment = Annotated[int, Int(0, MAX_FRAGMENTS - 1)]
Round = U32
"""Outer round of one fragment: how many times that fragment has been averaged."""
Shape = Annotated[tuple[int, ...], Seq(Int(0, 2**40), max_len=8)]
CodecName = Annotated[str, Str(choices=CODEC_NAMES)]
DType = Annotated[str, Str(choices=DTYPES)]
PeerState = Annotated[str, Str(choices=PEER_STATES)]
ShortText = Annotated[str, Str(max_len=64)]
Bulk = Annotated[bytes, Payload()]
MAX_HEARTBEAT_BANS = 8
"""Bans a heartbeat lists (its sender's latest): peers holding proof against one a heartbeat
does not list hand it over (``peer.audit.Audits.gossip``)."""

# Bytes per element of the codecs whose size is exact; the quantized ones carry block scales
# whose layout is protocol.codecs' business, so only bounds are checked for them.
_EXACT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
_MIN_BITS = {"int8": 8, "fp4": 4}


def check_tensor(shape: tuple[int, ...], numel: int, codec: str, payload_len: int) -> None:
    """Shape, element count and payload size must agree, so a peer cannot make us decode
    more (or less) than it announced."""
    if math.prod(shape) != numel:
        raise FieldError(f"shape {shape} holds {math.prod(shape)} elements, not numel={numel}")
    if codec in _EXACT_BYTES:
        if payload_len != numel * _EXACT_BYTES[codec]:
            raise FieldError(f"a {codec} payload of {numel} elements is {numel * _EXACT_BYTES[codec]} "
                             f"bytes, got {payload_len}")
    elif not (numel * _MIN_BITS[codec] + 7) // 8 <= payload_len <= 8 * numel + 1024:
        raise FieldError(f"a {codec} payload of {numel} elements cannot be {payload_len} bytes")


# ---------------------------------------------------------------------------------------
# Records in the DHT.


@message(Tag.HEARTBEAT)
@dataclass(frozen=True, kw_only=True, slots=True)
class Heartbeat(Message):
    """A peer's liveness and progress, stored under the run's peers key and expiring after
    ``SwarmConfig.heartbeat_ttl_s``. The peer table and the credit for tokens come from these."""

    run_id: RunId
    sent_at: UnixTime
    state: PeerState
    step: U64
    """Inner steps this peer has run in this run."""
    tokens: U64
    """Tokens trained on in this run, cumulative: the volunteer's credit."""
    tokens_per_s: Rate
    rounds: Annotated[tuple[int, ...], Seq(Int(0, 2**32 - 1), max_len=MAX_FRAGMENTS)]
    """Last completed outer round of each fragment."""
    state_digest: MaybeDigest
    """Digest of the ``StateIndex`` this peer can serve (its vouch), or b"" if none."""
    reachable: Annotated[bool, Bool()]
    """Accepts inbound connections; False behind NAT (reached through relays, or sends only)."""
    maddrs: Multiaddrs
    client: ShortText
    """Client name and version, e.g. ``swarmstream/0.1.0``."""
    device: ShortText
    """What trains, for the peer table, e.g. ``cuda NVIDIA H100``, ``cpu``."""
    banned: Annotated[tuple[bytes, ...], Seq(Bytes((KEY_BYTES,)), max_len=MAX_HEARTBEAT_BANS)] = ()
    """Keys this peer banned for a proven lie, its latest first. A hint of who still lacks a
    proof, never a reason to ban: only the proof itself bans."""


@message(Tag.RUN_ADVERTISED)
@dataclass(frozen=True, kw_only=True, slots=True)
class RunAdvertised(Message):
    """An entry of the public list of runs. Any peer may advertise; the manifest fetched by
    ``run_id`` is the truth, this is only a teaser for the run browser."""

    run_id: RunId
    sent_at: UnixTime
    name: Annotated[str, Str(min_len=1, max_len=64)]
    num_params: U64
    peers: U32
    """Live peers the advertiser counts."""
    step: U64


@message(Tag.REJECTED)
@dataclass(frozen=True, kw_only=True, slots=True)
class Rejected(Message):
    """Reply to any request a peer will not serve."""

    run_id: RunId
    request: Annotated[int, Int(0, 255)]
    """Tag of the refused request."""
    code: Annotated[str, Str(choices=REJECT_CODES)]
    detail: Line


# ---------------------------------------------------------------------------------------
# Averaging.


@message(Tag.JOIN_GROUP)
@dataclass(frozen=True, kw_only=True, slots=True)
class JoinGroup(Message):
    """Ask to average ``fragment`` for ``round``: "I am ready, with this much weight"."""

    run_id: RunId
    fragment: Fragment
    round: Round
    weight: Weight
    """Tokens this peer's pseudo-gradient covers; the average is weighted by them."""
    numel: U64
    """Elements of the fragment's flat vector; all members must agree."""


@message(Tag.GROUP_FORMED)
@dataclass(frozen=True, kw_only=True, slots=True)
class GroupFormed(Message):
    """The members of one averaging group, in order: member j reduces slice j."""

    run_id: RunId
    fragment: Fragment
    round: Round
    group_id: GroupId
    members: Annotated[tuple[bytes, ...], Seq(Bytes((KEY_BYTES,)), min_len=1, max_len=MAX_GROUP_SIZE)]
    weights: Annotated[tuple[float, ...], Seq(Float(0.0, 1e18), min_len=1, max_len=MAX_GROUP_SIZE)]
    numel: U64
    codec: CodecName
    deadline_s: Seconds
    """Seconds after this message by which every slice must be in; late members are dropped."""
    idle: Annotated[tuple[int, ...], Seq(Int(0, MAX_GROUP_SIZE - 1), max_len=MAX_GROUP_SIZE)] = ()
    """Indices of members that reduce no slice this round (ascending; at most
    ``protocol.butterfly.max_idle``): members that pushed nothing in the leader's last round
    with them (``peer.quiet``). They still push. The group ID covers them."""

    def check(self) -> None:
        if len(self.weights) != len(self.members):
            raise FieldError(f"{len(self.members)} members but {len(self.weights)} weights")
        if len(set(self.members)) != len(self.members):
            raise FieldError("a member appears twice")
        if list(self.idle) != sorted(set(self.idle)) or any(i >= len(self.members) for i in self.idle):
            raise FieldError(f"idle members {list(self.idle)} are not ascending indices of the members")
        if len(self.idle) > len(self.members) // 3:  # protocol.butterfly.max_idle
            raise FieldError(f"{len(self.idle)} idle members, more than a third of {len(self.members)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class _Slice(Message):
    """Fields shared by ``PushSlice`` and ``SliceAveraged``."""

    run_id: RunId
    fragment: Fragment
    round: Round
    group_id: GroupId
    part: Annotated[int, Int(0, MAX_GROUP_SIZE - 1)]
    """Index of the slice, and so of the member that reduces it."""
    offset: Annotated[int, Int(0, 2**48)]
    """First element of this slice in the fragment's flat vector."""
    numel: Annotated[int, Int(0, 2**40)]
    shape: Shape
    """Shape to decode to; ``(numel,)`` for butterfly slices of a flat vector."""
    dtype: DType
    codec: CodecName
    weight: Weight

    def check(self) -> None:
        check_tensor(self.shape, self.numel, self.codec, len(self.payload))  # type: ignore[attr-defined]


@message(Tag.PUSH_SLICE)
@dataclass(frozen=True, kw_only=True, slots=True)
class PushSlice(_Slice):
    """A member's encoded slice ``part``, sent to the member that reduces it. A slice larger
    than ``MAX_FRAME_BYTES`` is sent as several PushSlices with consecutive offsets."""

    stopping: Annotated[bool, Bool()]
    """The sender pauses, stops or catches up by a download: it started this round before its landing step, not
    because it reached it. The receiver does not count such frames as having waited for it
    (``peer.pace``: a node that keeps its group waiting is slow and follows)."""
    payload: Bulk
    """``protocol.codecs`` output for ``numel`` elements, as opaque bytes."""


@message(Tag.SLICE_AVERAGED)
@dataclass(frozen=True, kw_only=True, slots=True)
class SliceAveraged(_Slice):
    """The reducer's weighted mean of slice ``part``, sent back to every member.
    ``weight`` is the sum of the weights of ``contributors``."""

    contributors: Annotated[tuple[int, ...], Seq(Int(0, MAX_GROUP_SIZE - 1), min_len=1, max_len=MAX_GROUP_SIZE)]
    """Member indices whose slices are in the mean (a dropped member is missing here)."""
    inputs: Annotated[bytes, Bytes((DIGEST_BYTES,))]
    """The reducer's commitment to what it averaged (``protocol.audit.inputs_digest``): each
    contributor's key, weight and pushed chunks, its own slice's too (encoded with the group's
    codec, as it sent it to its witnesses and averaged it). An auditor that
    fetches those inputs recomputes the mean; a mean that does not follow from the inputs
    it committed to proves that the reducer lied."""
    own: Annotated[bytes, Bytes((DIGEST_BYTES,))]
    """The payload digest of the reducer's own slice's chunk over the same elements (it cuts
    its own slice and its mean alike): a witness (``protocol.butterfly.witnesses_of``) vouches
    for the own slice it got only if every chunk matches; one that does not, signed by the same
    reducer, proves a lie (``protocol.evidence.own_contradiction``)."""
    payload: Bulk

    def check(self) -> None:
        _Slice.check(self)
        if list(self.contributors) != sorted(set(self.contributors)):
            raise FieldError("contributors must be distinct and in increasing order")


@message(Tag.PARTS_HELD)
@dataclass(frozen=True, kw_only=True, slots=True)
class PartsHeld(Message):
    """After the reduced parts are in: which of them this member holds. ``digests[j]`` is the
    digest of part j as its reducer signed it (``peer.allreduce_round.part_digest``), or b""
    for a part it lacks. A member holding a part that another lacks forwards it the reducer's
    signed ``SliceAveraged`` frames; two digests for one part show that its reducer sent
    different means to different members."""

    run_id: RunId
    fragment: Fragment
    round: Round
    group_id: GroupId
    digests: Annotated[tuple[bytes, ...], Seq(Bytes((0, DIGEST_BYTES)), min_len=1, max_len=MAX_GROUP_SIZE)]
    norms: Annotated[tuple[float, ...], Seq(Float(0.0, 1.7e308), max_len=MAX_GROUP_SIZE)] = ()
    """The L2 norm of this member's own slice of each part (its contribution to that part's
    reducer), or empty. With the others' reports it bounds how large a reduced part can be
    (``protocol.butterfly.mean_norm_bound``): a reducer returning a far larger mean is not
    believed."""
    dots: Annotated[tuple[float, ...], Seq(Float(-1.7e308, 1.7e308), max_len=MAX_GROUP_SIZE)] = ()
    """For each part j this member holds and contributed to: ``<mean of part j, its own slice
    of j as the reducer decoded it>`` (0.0: not known, for a part it lacked when it reported, or
    one it did not contribute to), or empty. With the others' reports it shows a mean that its
    contributions cannot give (``protocol.butterfly.mean_consistent``), within the round."""
    final: Annotated[bool, Bool()] = False
    """True: this member has finished the round, and ``digests`` are the parts it landed (b""
    for a part it fell back on), not the ones it holds. A member still in the round weighs
    the finished members' finals for a part whose reducer came late
    (``peer.allreduce_round.Round.conform``)."""
    witness: Annotated[tuple[float, ...], Seq(Float(-1.7e308, 1.7e308), max_len=4)] = ()
    """For each part this member witnesses (``protocol.butterfly.witnesses_of``; two, in part
    order: 4 floats, ``2 x butterfly.WITNESSES``), ``norm, dot``: of the reducer's own slice as
    it sent it to this member (``PushSlice`` frames of its own part) and matching the mean's
    ``own``, and its dot with that mean; ``-1.0, 0.0`` where it cannot vouch (it lacks the
    slice or the mean, or they do not match). Empty in a group without witnesses. The screen
    then counts the reducer's term as reported (``protocol.butterfly.screen_mean``); a
    witness of another length, or a negative norm, tells it nothing."""


@message(Tag.AUDIT_REQUEST)
@dataclass(frozen=True, kw_only=True, slots=True)
class AuditRequest(Message):
    """A member asks the reducer of ``part`` for the inputs of its mean (``protocol.audit``):
    the contributors' signed pushes it averaged, and its own slice's (``protocol.audit``)."""

    run_id: RunId
    fragment: Fragment
    round: Round
    group_id: GroupId
    part: Annotated[int, Int(0, MAX_GROUP_SIZE - 1)]


@message(Tag.EVIDENCE)
@dataclass(frozen=True, kw_only=True, slots=True)
class Evidence(Message):
    """Proof that a peer lied, handed on to the members of the group it lied to: ``payload``
    is a msgpack list of the signed frames that prove it (``protocol.evidence.proves``). The
    receiver checks the proof itself; the sender vouches for nothing."""

    run_id: RunId
    payload: Bulk


MAX_EVIDENCE_PIECES = 4096
"""Pieces of one proof (no more than its frames: ``peer.bans.MAX_EVIDENCE_FRAMES``)."""


@message(Tag.EVIDENCE_PIECE)
@dataclass(frozen=True, kw_only=True, slots=True)
class EvidencePiece(Message):
    """A piece of a proof too large for one ``Evidence`` frame (an audit's: a part's mean and
    every input it averaged): ``payload`` is a msgpack list of consecutive frames of the proof,
    the ``piece``-th of ``pieces``, and ``whole`` is ``protocol.evidence.proof_digest`` of all
    of them in order, which the receiver checks once every piece is in, before it checks the
    proof (``peer.proofs.ProofsMixin.evidence_piece``). The sender vouches for nothing."""

    run_id: RunId
    whole: Digest
    piece: Annotated[int, Int(0, MAX_EVIDENCE_PIECES - 1)]
    pieces: Annotated[int, Int(2, MAX_EVIDENCE_PIECES)]
    payload: Bulk

    def check(self) -> None:
        if self.piece >= self.pieces:
            raise FieldError(f"piece {self.piece} of {self.pieces}")


# ---------------------------------------------------------------------------------------
# State sync.


@message(Tag.REQUEST_STATE_INDEX)
@dataclass(frozen=True, kw_only=True, slots=True)
class RequestStateIndex(Message):
    """Ask a donor for the index of the global state it holds now."""

    run_id: RunId


@message(Tag.STATE_INDEX, max_size=MAX_HEAD_BYTES)
@dataclass(frozen=True, kw_only=True, slots=True)
class StateIndex(Message):
    """What a full copy of the global state is made of: parameters, outer-optimizer state and
    counters, serialized (``format``) and cut into chunks of ``chunk_bytes``. Its digest (of
    the encoded message) is what heartbeats vouch for."""

    run_id: RunId
    step: U64
    rounds: Annotated[tuple[int, ...], Seq(Int(0, 2**32 - 1), max_len=MAX_FRAGMENTS)]
    format: Annotated[str, Str(min_len=1, max_len=32)]
    total_bytes: Annotated[int, Int(0, 2**48)]
    chunk_bytes: Annotated[int, Int(1, 1 << 28)]
    chunk_digests: Annotated[tuple[bytes, ...], Seq(Bytes((DIGEST_BYTES,)), max_len=MAX_STATE_CHUNKS)]
    """SHA-256 of each chunk's payload (``protocol.messages.digest``)."""

    def check(self) -> None:
        want = -(-self.total_bytes // self.chunk_bytes)
        if len(self.chunk_digests) != want:
            raise FieldError(f"{self.total_bytes} bytes in chunks of {self.chunk_bytes} need {want} "
                             f"digests, got {len(self.chunk_digests)}")


@message(Tag.REQUEST_STATE_CHUNK)
@dataclass(frozen=True, kw_only=True, slots=True)
class RequestStateChunk(Message):
    """Ask a donor for one chunk of the state described by the index with ``index_digest``."""

    run_id: RunId
    index_digest: Digest
    chunk: U32


@message(Tag.STATE_CHUNK)
@dataclass(frozen=True, kw_only=True, slots=True)
class StateChunk(Message):
    """One chunk of state. The receiver checks its payload digest (which the envelope hands
    over, computed once) against the index before using it."""

    run_id: RunId
    index_digest: Digest
    chunk: U32
    payload: Bulk
