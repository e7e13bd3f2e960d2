"""Butterfly all-reduce of one fragment's flat fp32 vector among a formed group, over libp2p.

The arithmetic is ``protocol.butterfly``'s and must match ``peer.simulation.allreduce`` bit for
bit: member j reduces slice j. Every member encodes its foreign slices with the group's codec
and pushes them (``PushSlice``) to their reducers; reducer j accumulates in fp32, in member
index order, ``weight_i / total * decode(slice_i)`` for every contributor i (its own slice
unencoded, at its own index), each first scaled down to at most ``clip`` x the lower median
of their norms (``protocol.butterfly.clip_scales``: the robust mean), encodes that mean once
and pushes it (``SliceAveraged``) to every other contributor. Every member, the reducer
included, keeps the *decoded* mean, so all members that got part j hold the same bytes for it.

Transport. One handler per run (``HANDLER_PREFIX`` + run ID) on hivemind's P2P binary
streams. Everything is a push: a sender opens a stream to a member, writes its frames and
closes it once the member has acknowledged each (one byte per frame, ``peer.outbox``; what is
not acknowledged in time goes again on a new stream); nothing else is answered, so a reducer
never holds a stream open while it waits for the others. A frame is an 8-byte big-endian length (hivemind's
``P2P.send_raw_data`` framing) followed by one signed envelope; the length is checked against
``max_frame_bytes`` before a byte of the body is read. A slice whose envelope would exceed
that is sent as several messages with consecutive offsets, cut at multiples of 256 elements
(a multiple of every codec's block), so the decoded values are those of one whole encoding.

Checks on every frame: the envelope's signature, that it is for this run (then round,
fragment and group through the signed context), that its signer is the libp2p peer the
stream came from (libp2p authenticated that connection with the same key), that the signer
is the member expected for that part, and the slice's codec, dtype, shape ``(numel,)``,
offset and extent, weight, and that it decodes to finite values. Any failure drops that
member from the round (``reason=... peer=<peer id>`` in the log): nothing it sent is used,
its slice is not reduced, and its own reduced part falls back (below). A frame that does not
even verify is blamed on the stream's remote peer, which libp2p authenticated. A frame that
is validly signed and that no honest client sends (NaN values, a misshapen slice) is also
returned as evidence (``AllReduceOutcome.offences``, ``protocol.evidence``); the node bans its
signer (``peer.bans``), and from then on our reductions leave out its pushes (``banned``)
while its groups, its lateness and its own reduced parts are handled like anyone's, so the
members land one average whether or not they have seen the evidence, and at the same time.

Deadlines (``D = group.deadline_s``, from the moment ``allreduce`` is called): pushes for our
slice must be in by ``D``; members missing then are dropped and the reducer averages the rest,
re-weighted over the members it actually received from (``SliceAveraged.contributors``,
``weight`` = their summed weight). Reduced parts must be in by ``1.5 * D``. Every send and
read is bounded by the deadlines, so no round can hang on a stalled or killed member.

Agreement (``peer.allreduce_round``). Then every member tells the others which parts it holds
(``PartsHeld``, a digest per part) and forwards the reducer's signed ``SliceAveraged`` frames
of a part it holds to a member that reports lacking it; a member takes a forwarded part once
one forwarder has sent all of it, checked as if its reducer had sent it. Each waits until
every member it knows took part has reported (``Round.took_part``: not one banned for a lie)
and it holds every part someone holds, or ``2.5 * D``. So a member that timed out on a part, or whose slice a reducer dropped as late (a
reducer sends its mean to its contributors, and members it banned, only), still ends the round with the part the
others hold: members that timed out on each other no longer land different averages. A
member keeps the parts of its last few finished rounds to answer a report that comes after it
finished. ``AllReduceOutcome.agreed`` says whether this member saw the agreement complete.

Finals. A member that finishes sends every other member the parts it landed (a final
``PartsHeld``), and answers a report that comes after it finished with it. A member that
started so late that the others landed before its part existed (it was starved, or busy
with its previous round) falls back on its own part as they did (``Round.conform``), and
takes the parts they landed from their finished rounds: one result for the group, not a
repair rounds later.

Fallback. A part that nobody reported holding by then (its reducer died, or failed every
member) holds *this member's own value* in the returned average, and is listed in
``AllReduceOutcome.fallback_parts``. ``peer.node``, whose vectors are pseudo-gradients,
replaces those parts with zeros (that slice of the global copy stays where it was), which is
the same on every surviving member.

Memory bounds (``peer.inbox``). Frames may arrive before the local member has called
``allreduce`` for their group (it learned of the group a little later than the sender). They
are verified (signature, run, sender) and buffered per group ID, at most ``max_pending_groups``
groups (the oldest is evicted) and ``max_pending_bytes`` in all, and one peer's frames in at
most ``max_pending_groups_per_peer`` groups and ``max_pending_bytes_per_peer`` bytes (frames
beyond are dropped), each group for at most ``pending_ttl_s``. Frames for a group this member
already finished are dropped (a bounded memory of recent group IDs). A peer may hold at most
``max_streams_per_peer`` averaging streams open to us and have one frame body being read at
a time. So failed or foreign rounds, or one flooding identity, cannot grow memory or take more than
its share of the buffer. Raise ``max_pending_bytes`` (and ``max_pending_bytes_per_peer``) if
you see ``reason=pending_full`` (``peer_pending_full``) with large fragments. A slice left
short because *we* dropped some of its frames at a limit is not blamed on its sender.

Short slices. A sender writes all of its slice (or part) on one stream and then closes it. A
stream that ends with the slice it carried short (signed, well-formed frames that do not
cover it) will not be completed: the sender is dropped at once (``reason=short:...``), not at
the deadline, and then counts as late (``allreduce_round.LATE``).

Only asyncio: no threads or processes. Encoding and decoding run on the event loop (they are
vectorized torch ops; a 64 MB slice takes tens of milliseconds).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from collections.abc import Awaitable, Callable
from typing import Any

import torch
from hivemind.p2p import P2P

from peer.allreduce_round import Round
from peer.audit import Audits
from peer.inbox import HEADER_LEN, FrameTooLarge, PendingFrames, StreamEnded, StreamGate, TooManyStreams, \
    peek_group, read_body, read_header
from peer.outbox import ACK, MAX_UNREAD_ACKS, send_frames
from peer.ratelimit import RateLimiter
from protocol.codecs import get_codec
from protocol.envelope import seal_parts, verify
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.identity import Identity, peer_id_from_public_key
from protocol.messages import MAX_FRAME_BYTES
from protocol.messages_swarm import AuditRequest, Evidence, PartsHeld, PushSlice, SliceAveraged

__all__ = ["HANDLER_PREFIX", "AllReduceOutcome", "Averager", "Group", "chunk_elements"]

log = logging.getLogger(__name__)

HANDLER_PREFIX = "swarmstream-avg-v7-"  # v2: acknowledged frames (peer.outbox); v3: norms; v4: audits; v5: finals;
# v6: PushSlice.stopping; v7: PartsHeld.dots, and norms of the pushes as decoded
CHUNK_ALIGN = 256  # elements: a multiple of every codec's block (int8: 256, fp4: 32)
_HEAD_ROOM = 4096  # bytes of a frame that are not payload: envelope and message heads
RESULT_GRACE = 0.5  # reduced parts are due by (1 + RESULT_GRACE) * deadline_s
AGREE_GRACE = 1.0  # reports and forwarded parts by (1 + AGREE_GRACE) * deadline_s
ELSEWHERE_GRACE = 0.1  # of deadline_s: a part others reported holding this long is not waited for
_RECENT_ROUNDS = 4  # finished rounds whose parts we still forward to a member that reports lacking one
_FINISHED_MEMORY = 1024  # group IDs of finished rounds whose late frames we drop quietly


@dataclass(frozen=True, slots=True)
class Group:
    """What a verified ``GroupFormed`` says: who averages, in which order, how."""

    run_id: bytes
    fragment: int
    round: int
    group_id: bytes
    members: tuple[bytes, ...]
    """Ed25519 public keys, ordered: member j reduces slice j."""
    weights: tuple[float, ...]
    numel: int
    codec: str
    deadline_s: float
    formed_at: int = 0
    """Our sync count when it formed (``peer.distrust``'s clock): an audit's verdict on a group
    formed before a suspension began belongs to that suspension."""


@dataclass(slots=True)
class AllReduceOutcome:
    average: torch.Tensor
    """(numel,) fp32: identical on every member that finished, except ``fallback_parts``."""
    dropped: tuple[int, ...]
    """Member indices excluded from this member's round (timed out, unreachable, bad signature,
    shape, codec or values)."""
    fallback_parts: tuple[int, ...]
    """Slices whose reducer was dropped: those elements hold this member's own value."""
    bytes_sent: int
    bytes_received: int
    elapsed_s: float
    partial_parts: tuple[int, ...] = ()
    """Parts that their reducer averaged without some member (it dropped that one's slice)."""
    repaired_parts: tuple[int, ...] = ()
    """Parts we lacked when we reported and got after it, resent by their reducer or forwarded
    by another member (signed by the reducer), so we hold what the others hold."""
    agreed: bool = True
    """Every member we waited for reported, nobody holds a part we lack, and no two members
    hold different means of one part: as far as this member can see, the group's members
    finish the round with the same average (a part proven equivocated falls back on every
    member that holds the proof). False: compare states after the round."""
    clipped: tuple[int, ...] = ()
    """Members whose slice we scaled down, as the reducer of our part, because its norm was
    over ``clip`` x the lower median of the contributions' norms (protocol.butterfly)."""
    refused: tuple[bytes, ...] = ()
    """Public keys of the reducers whose mean we refused as too large for its contributions
    (``Round.implausible``): not proof, but every member of the group saw the same. (A mean
    the screen refused, ``Round.inconsistent``, is audited instead: two colluding members can
    make an honest one fail it.)"""
    offences: tuple[tuple[bytes, str, bytes | tuple[bytes, bytes]], ...] = ()
    """Proven lies seen in this round: (signer's public key, what is wrong, the signed frame,
    or the two frames of an equivocation), one per signer (``protocol.evidence``);
    ``peer.bans`` keeps them."""
    followed: tuple[int, ...] = ()
    """Parts we held and fell back on because the members that finished before us landed
    without them (``Round.conform``); also in ``fallback_parts``."""
    kept_waiting_s: float = 0.0
    """How long half the other members' frames for this group had waited for us when we
    started it: we reached the round that much after them (``peer.pace``)."""


def chunk_elements(max_frame_bytes: int) -> int:
    """Elements per message so that any codec's envelope fits in ``max_frame_bytes`` (4 bytes
    per element is the largest codec), a multiple of ``CHUNK_ALIGN``."""
    return (max_frame_bytes - _HEAD_ROOM) // 4 // CHUNK_ALIGN * CHUNK_ALIGN


def _chunks(start: int, end: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(a + step, end)) for a in range(start, end, step)]


class Averager:
    """Runs the all-reduces of one run's groups on one P2P instance (see the module docstring).

    ``max_frame_bytes`` bounds every frame we read or write; keep it equal across a run's
    peers (a smaller value on a receiver refuses the larger frames of others). Lower it on
    memory-starved peers; raise it for fewer messages per slice.
    """

    def __init__(self, p2p: P2P, identity: Identity, run_id: bytes, *, max_pending_groups: int = 8,
                 max_frame_bytes: int = 64 << 20, max_pending_bytes: int | None = None,
                 max_pending_groups_per_peer: int | None = None, max_pending_bytes_per_peer: int | None = None,
                 max_streams_per_peer: int = 32, pending_ttl_s: float = 120.0, read_timeout_s: float = 30.0,
                 upload: RateLimiter | None = None, download: RateLimiter | None = None,
                 clip: float = 2.0, max_weight: float = 1e18, audit: float = 0.0):
        if not 2 * _HEAD_ROOM <= max_frame_bytes <= MAX_FRAME_BYTES:
            raise LocalProtocolError(f"max_frame_bytes must be in [{2 * _HEAD_ROOM}, {MAX_FRAME_BYTES}], "
                                     f"got {max_frame_bytes}")
        if max_pending_groups < 0:
            raise LocalProtocolError("max_pending_groups must be >= 0")
        self.p2p = p2p
        self.identity = identity
        self.run_id = bytes(run_id)
        self.max_frame_bytes = max_frame_bytes
        total = 4 * max_frame_bytes if max_pending_bytes is None else max_pending_bytes
        self._pending = PendingFrames(
            max_groups=max_pending_groups, max_bytes=total, ttl_s=pending_ttl_s,
            max_groups_per_peer=(max(1, max_pending_groups // 4) if max_pending_groups_per_peer is None
                                 else max_pending_groups_per_peer),
            max_bytes_per_peer=(min(total, max(total // 4, max_frame_bytes)) if max_pending_bytes_per_peer is None
                                else max_pending_bytes_per_peer))
        self._gate = StreamGate(max_streams_per_peer)
        self.read_timeout_s = read_timeout_s
        self.clip = clip  # the run's sync.clip: robust mean (protocol.butterfly)
        self.max_weight = max_weight  # the run's most tokens one sync may cover
        self.audits = Audits(self, audit, clip)
        """Our audits of other reducers' means (``peer.audit``; ``audit``: the run's sync.audit)."""
        self.banned: set[str] | frozenset[str] = frozenset()
        """Peer IDs banned for a proven lie: their pushes are averaged by no round of ours
        (``peer.bans`` keeps this set; the node hands it over)."""
        self.reconnect: Callable[[str], Awaitable[bool]] | None = None
        """Called with a peer ID when no stream to it could be opened; True if it opened
        another way there (the node dials peers behind NAT through their relays)."""
        # the volunteer's bandwidth caps (shared with the node, which changes their rates)
        self.upload = upload or RateLimiter()
        self.download = download or RateLimiter()
        self.handler_name = HANDLER_PREFIX + self.run_id.hex()
        self._active: dict[bytes, Round] = {}
        self._finished: deque[bytes] = deque(maxlen=_FINISHED_MEMORY)
        self._recent: OrderedDict[bytes, Round] = OrderedDict()  # finished rounds whose parts we forward
        self._side_tasks: set[asyncio.Task[None]] = set()  # forwards for finished rounds
        self._started = False

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._handle_stream)
        self._started = True

    async def shutdown(self) -> None:
        if self._started:
            self._started = False
            try:
                await self.p2p.remove_binary_stream_handler(self.handler_name)
            except Exception as e:  # noqa: BLE001  (the daemon may be gone already; nothing else to undo)
                log.info("could not remove the averaging handler reason=%r", e)
        self._pending.clear()
        self._recent.clear()
        for t in list(self._side_tasks):
            t.cancel()

    @property
    def pending(self) -> PendingFrames:
        """Frames buffered for groups not started yet (bounded; see ``peer.inbox``)."""
        return self._pending

    # --- inbound ------------------------------------------------------------------------

    async def _handle_stream(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer_id = info.peer_id.to_base58()
        carried: set[tuple[bytes, type]] = set()  # (group, PushSlice or SliceAveraged) this stream carried
        try:
            async with self._gate.stream(peer_id):
                while True:
                    size = await read_header(reader, self.max_frame_bytes, self.read_timeout_s)
                    if size is None:
                        self._stream_ended(peer_id, carried)
                        break
                    async with self._gate.body(peer_id):  # one of a peer's frames being read at a time
                        data = await read_body(reader, size, self.read_timeout_s)
                        await self.download.take(HEADER_LEN + size)  # holds back the sender under a cap
                        key = self._on_frame(peer_id, data)
                        del data  # or this stream holds its last frame while it waits for the next
                    writer.write(ACK)  # read and handled: the sender closes once all are (peer.outbox)
                    if writer.transport.get_write_buffer_size() > MAX_UNREAD_ACKS:
                        log.info("averaging stream closed reason=acks_not_read peer=%s", peer_id)
                        break  # it does not read what we answer: no buffer of ours grows for it
                    if key is not None:
                        carried.add(key)
        except TooManyStreams as e:
            log.warning("averaging stream refused reason=too_many_streams peer=%s detail=%s", peer_id, e)
        except FrameTooLarge as e:
            self._blame(peer_id, None, f"frame_too_large:{e}")
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            log.info("averaging stream ended early reason=%s peer=%s", type(e).__name__, peer_id)
        finally:
            writer.close()

    def _on_frame(self, peer_id: str, data: bytes) -> tuple[bytes, type] | None:
        """Handle one frame; -> (group ID, message type) of a slice or part the stream's peer
        sent for itself (what its stream's end says something about), else None."""
        try:
            v = verify(data, expect=(PushSlice, SliceAveraged, PartsHeld, AuditRequest, Evidence), run_id=self.run_id,
                       max_size=self.max_frame_bytes)
            if self.audits.take(peer_id, v, data):  # the inputs of a mean we audit, shown by its reducer
                return None
            forwarded = v.peer_id != peer_id
            if forwarded and not isinstance(v.message, SliceAveraged):  # only reduced parts are forwarded
                verify(data, run_id=self.run_id, sender=peer_id, max_size=self.max_frame_bytes)  # raises
        except RemoteProtocolError as e:
            self._blame(peer_id, peek_group(data), f"{type(e).__name__}:{e}")
            return None
        if isinstance(v.message, AuditRequest):
            self.audits.answer(peer_id, v.message)
            return None
        if isinstance(v.message, Evidence):
            self.audits.evidence(peer_id, v.message)
            return None
        gid = bytes(v.message.group_id)  # type: ignore[attr-defined]
        nbytes = HEADER_LEN + len(data)
        rnd = self._active.get(gid)
        if forwarded:  # a part we reported lacking; unasked for outside a round, so not buffered
            if rnd is not None:
                rnd.accept_forwarded(peer_id, v, nbytes, data)
                if rnd.agreeing:  # it may have completed a part others lack, or proven an equivocation
                    self._forward(rnd, rnd.tasks)
            return None
        if rnd is not None:
            rnd.accept(peer_id, v, nbytes, data)
            if isinstance(v.message, PartsHeld) and rnd.agreeing:
                self._forward(rnd, rnd.tasks)
        elif gid in self._recent and isinstance(v.message, PartsHeld):
            rnd = self._recent[gid]
            rnd.accept(peer_id, v, nbytes, data)  # a member late to the agreement: it may lack a part
            self._forward(rnd, self._side_tasks)
            if not v.message.final and peer_id in rnd.index:  # and it should know what we landed
                self._tell_landed(rnd, [rnd.index[peer_id]])
        elif gid in self._finished:
            log.debug("frame for a finished group dropped peer=%s group=%s", peer_id, gid.hex())
            return None
        elif not self._pending.add(gid, peer_id, v, nbytes, data,  # a banned member's earliness decides nothing
                                   waits=isinstance(v.message, PushSlice) and not v.message.stopping
                                   and peer_id not in self.banned):
            return None  # dropped at a limit of ours: its stream's end says nothing about the sender
        return None if isinstance(v.message, PartsHeld) else (gid, type(v.message))

    def _stream_ended(self, peer_id: str, carried: set[tuple[bytes, type]]) -> None:
        """The peer closed a stream that carried its slices or parts: any it left short stay so."""
        for gid, kind in carried:
            rnd = self._active.get(gid)
            if rnd is not None:
                rnd.stream_ended(peer_id, kind)
            else:
                self._pending.note(gid, peer_id, StreamEnded(kind))

    def _forward(self, rnd: Round, tasks: Any) -> None:
        """Send members that reported lacking a part we hold (or holding another mean of it)
        its signed frames, and members that reported holding a part we proved equivocated the
        proof (see ``peer.allreduce_round``), each part to each member once, within the
        agreement's time."""
        loop = asyncio.get_running_loop()
        deadline = rnd.agree_deadline if rnd.agree_deadline > loop.time() else loop.time() + rnd.group.deadline_s
        sends = []
        for i, j in rnd.forward_wanted():
            rnd.forwarded.add((i, j))
            log.info("forwarding reduced part part=%d to=%s group=%s", j, rnd.peer_ids[i], rnd.group.group_id.hex())
            sends.append((i, rnd.frames[j]))
        for i, j in rnd.proof_wanted():
            rnd.proved.add((i, j))
            log.info("forwarding proof of equivocation part=%d to=%s group=%s", j, rnd.peer_ids[i],
                     rnd.group.group_id.hex())
            sends.append((i, [[frame] for frame in rnd.convicted[j]]))
        for i, frames in sends:
            task = asyncio.create_task(self._deliver(rnd, i, frames, deadline, rnd.sent, False))
            if isinstance(tasks, set):
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            else:
                tasks.append(task)

    def _tell_landed(self, rnd: Round, members: list[int]) -> None:
        """Send ``members`` our final report: the parts we landed (``Round.landed``), each once."""
        members = [i for i in members if i not in rnd.told and i != rnd.me]
        if not rnd.landed or not members:
            return
        g = rnd.group
        final = PartsHeld(run_id=g.run_id, fragment=g.fragment, round=g.round, group_id=g.group_id,
                          digests=rnd.landed, final=True)
        frames = [seal_parts(final, self.identity)]
        deadline = asyncio.get_running_loop().time() + g.deadline_s
        for i in members:
            rnd.told.add(i)
            task = asyncio.create_task(self._deliver(rnd, i, frames, deadline, rnd.sent, False))
            self._side_tasks.add(task)
            task.add_done_callback(self._side_tasks.discard)

    def _blame(self, peer_id: str, gid: bytes | None, reason: str) -> None:
        """A frame from ``peer_id`` (authenticated by libp2p) was bad: drop it from the round
        the frame claims, or from every round it is in if the frame names none we know."""
        log.warning("rejected slice reason=%s peer=%s", reason, peer_id)
        if gid is not None and gid in self._active:
            rounds = [self._active[gid]]
        elif gid is not None and gid not in self._finished:
            self._pending.add(gid, peer_id, reason)
            return
        else:
            rounds = [r for r in self._active.values() if peer_id in r.index]
        for r in rounds:
            if peer_id in r.index:
                r.drop(r.index[peer_id], reason)

    # --- outbound -----------------------------------------------------------------------

    async def _send_frames(self, peer_id: str, frames: list[list[Any]]) -> int:
        """Send frames (sealed parts) to ``peer_id`` until each is acknowledged (``peer.outbox``).
        -> bytes sent."""
        return await send_frames(self.p2p, peer_id, self.handler_name, frames, upload=self.upload,
                                 reconnect=self.reconnect)

    def _encode(self, rnd: Round, part: int, values: torch.Tensor) -> list[tuple[int, int, bytes]]:
        """``values`` (the elements of slice ``part``) encoded in chunks: [(start, end, bytes)]."""
        s, e = rnd.bounds[part]
        return [(a, b, rnd.codec.encode(values[a - s:b - s]))
                for a, b in _chunks(s, e, chunk_elements(self.max_frame_bytes))]

    def _frames(self, rnd: Round, part: int, encoded: list[tuple[int, int, bytes]], weight: float,
                contributors: tuple[int, ...] | None, inputs: bytes = b"") -> list[list[Any]]:
        """Sealed PushSlices (or SliceAverageds, with ``contributors``) carrying ``encoded``."""
        g = rnd.group
        frames = []
        for a, b, payload in encoded:
            common: dict[str, Any] = {
                "run_id": g.run_id, "fragment": g.fragment, "round": g.round, "group_id": g.group_id, "part": part,
                "offset": a, "numel": b - a, "shape": (b - a,), "dtype": "float32", "codec": g.codec,
                "weight": weight, "payload": payload}
            msg = (PushSlice(stopping=rnd.stopping, **common) if contributors is None
                   else SliceAveraged(contributors=contributors, inputs=inputs, **common))
            frames.append(seal_parts(msg, self.identity))
        return frames

    # --- the all-reduce -----------------------------------------------------------------

    async def allreduce(self, group: Group, vector: torch.Tensor, weight: float, *,
                        stopping: bool = False) -> AllReduceOutcome:
        """Average ``vector`` (numel,) with the group's other members; see the module docstring.
        Never waits more than ``2.5 * group.deadline_s`` (plus the local encode/decode), and
        that long only when a member that took part never reports. ``stopping``: we pause, stop
        or catch up by a download, so we started before our landing step (``PushSlice.stopping``)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        started = time.perf_counter()
        me = self._check_call(group, vector, weight)
        vec = vector.detach().to(device="cpu", dtype=torch.float32).reshape(-1).contiguous()
        if len(group.members) == 1:
            return AllReduceOutcome(vec.clone(), (), (), 0, 0, time.perf_counter() - started)
        gid = bytes(group.group_id)
        if gid in self._active:
            raise LocalProtocolError(f"group {gid.hex()} is already averaging")
        excluded = frozenset(i for i, key in enumerate(group.members) if peer_id_from_public_key(key) in self.banned)
        rnd = Round(group, me, vec, get_codec(group.codec), self.clip, excluded, self.banned)
        rnd.stopping = stopping
        self._active[gid] = rnd
        kept_waiting = self._pending.waited(gid, [p for i, p in enumerate(rnd.peer_ids) if i != me])
        for peer_id, item, nbytes, data in self._pending.pop(gid):  # in arrival order
            if isinstance(item, StreamEnded):
                rnd.stream_ended(peer_id, item.kind)
            elif isinstance(item, str):
                if peer_id in rnd.index:
                    rnd.drop(rnd.index[peer_id], item)
            else:
                rnd.accept(peer_id, item, nbytes, data)
        tasks, sent = rnd.tasks, rnd.sent
        try:
            push_deadline = t0 + group.deadline_s
            end_deadline = t0 + (1 + RESULT_GRACE) * group.deadline_s
            rnd.agree_deadline = t0 + (1 + RESULT_GRACE + AGREE_GRACE) * group.deadline_s
            for j in range(rnd.n):
                if j != me and rnd.size(j):
                    s, e = rnd.bounds[j]
                    encoded = self._encode(rnd, j, vec[s:e])
                    rnd.pushing(j, encoded)  # what its reducer will average: our report's norm and dot of it
                    frames = self._frames(rnd, j, encoded, group.weights[me], None)
                    tasks.append(asyncio.create_task(self._deliver(rnd, j, frames, push_deadline, sent, True)))
            await self._wait(rnd, rnd.pushes_done, push_deadline)
            rnd.collecting_pushes = False
            for i in range(rnd.n):
                if i != me and i not in rnd.dropped and rnd.pushed[i] != rnd.size(me):
                    rnd.drop(i, "timeout:slice not received in time")

            if rnd.size(me):
                mean, contrib, total = rnd.reduce()
                inputs = rnd.commit(contrib, _chunks(*rnd.bounds[me], chunk_elements(self.max_frame_bytes)))
                encoded = self._encode(rnd, me, mean)
                frames = self._frames(rnd, me, encoded, total, contrib, inputs)
                rnd.reduced(contrib, encoded, frames)
                # a banned member on time is alive: it needs our part too (one dropped as late
                # gets it as any late member does, forwarded on its report)
                for i in sorted(set(contrib) | (rnd.excluded - rnd.dropped.keys())):
                    if i != me:
                        tasks.append(asyncio.create_task(self._deliver(rnd, i, frames, end_deadline, sent, False)))

            await self._wait_means(rnd, end_deadline)
            for j in range(rnd.n):
                if j != me and j not in rnd.dropped and rnd.got[j] != rnd.size(j):
                    rnd.drop(j, "timeout:reduced part not received in time" if loop.time() >= end_deadline
                             else "timeout:reduced part held by others, not sent to us")
            await self._agree(rnd)
            rnd.collecting_means = False
            while True:  # our sends, forwards answering reports that come meanwhile included
                unsent = [t for t in tasks if not t.done()]
                left = rnd.agree_deadline - loop.time()
                if not unsent or left <= 0:
                    break
                await asyncio.wait(unsent, timeout=left)
        finally:
            # from here a report for this group is answered from the finished rounds' parts
            self._active.pop(gid, None)
            self._finished.append(gid)
            self._recent[gid] = rnd
            while len(self._recent) > _RECENT_ROUNDS:
                self._recent.popitem(last=False)
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

        # a part nobody forwarded to us, nor holds: its reducer failed every member alike; a
        # part whose reducer we proved sent different means (every member that holds the proof);
        # one far larger than its contributions allow (every member, from the same reports); or
        # a late reducer's part that the members which finished first landed without
        implausible = rnd.implausible()
        # refused by the screen: not theirs to give, unless two members lied in their reports,
        # so the audit of the part (any member's, whatever the rate) is what convicts its reducer
        inconsistent = [j for j in rnd.inconsistent() if j not in implausible]
        conformed = rnd.conform()
        fallback = tuple(j for j in range(rnd.n) if rnd.size(j) and (
            not rnd.holds(j) or j in rnd.convicted or j in implausible or j in inconsistent or j in conformed))
        for j in fallback:
            s, e = rnd.bounds[j]
            rnd.result[s:e] = vec[s:e]
        partial = tuple(j for j, contrib in sorted(rnd.contributors.items())
                        if rnd.holds(j) and len(contrib) < rnd.n)
        mine = rnd.digests()
        disputed = tuple(j for j in range(rnd.n) if j not in rnd.convicted
                         and mine[j] and any(r[j] and r[j] != mine[j] for r in rnd.reports.values()))
        rnd.landed = tuple(b"" if j in fallback else mine[j] for j in range(rnd.n))
        self._tell_landed(rnd, [i for i in range(rnd.n) if i != me and i not in rnd.finals and i not in rnd.gone])
        rnd.retire()
        self.audits.after(rnd, fallback, suspect=inconsistent)
        if disputed:
            log.warning("members hold different means of one part parts=%s group=%s: its reducer sent "
                        "different ones", list(disputed), gid.hex())
        offences, rnd.offences = tuple(rnd.offences.values()), {}  # the round is kept a while: not its evidence
        self.audits.hand_on(rnd, offences)
        return AllReduceOutcome(rnd.result, tuple(sorted(rnd.dropped)), fallback, sent[0], rnd.bytes_received,
                                time.perf_counter() - started, partial, tuple(sorted(rnd.repaired)),
                                rnd.settled() and not disputed and not rnd.apart(), tuple(rnd.clipped),
                                tuple(bytes(rnd.group.members[j]) for j in implausible), offences, tuple(conformed),
                                kept_waiting)

    async def _agree(self, rnd: Round) -> None:
        """Tell every member which parts we hold, forward the ones they lack, and wait for what
        they hold and we lack, until every member we wait for has reported (see
        ``peer.allreduce_round``) or the agreement's deadline."""
        g = rnd.group
        rnd.agreeing = True
        rnd.early = not rnd.heard_from_anyone()
        rnd.reported = rnd.digests()
        report = PartsHeld(run_id=g.run_id, fragment=g.fragment, round=g.round, group_id=g.group_id,
                           digests=rnd.reported, norms=tuple(rnd.norms), dots=rnd.my_dots())
        frames = [seal_parts(report, self.identity)]
        for i in range(rnd.n):
            if i != rnd.me and not rnd.dropped.get(i, "").startswith("unreachable"):
                rnd.tasks.append(asyncio.create_task(self._report(rnd, i, frames)))
        self._forward(rnd, rnd.tasks)  # reports that came before ours
        await self._wait(rnd, rnd.agreed, rnd.agree_deadline)

    def _check_call(self, group: Group, vector: torch.Tensor, weight: float) -> int:
        if group.run_id != self.run_id:
            raise LocalProtocolError("the group is for another run than this averager's")
        if not self._started:
            raise LocalProtocolError("Averager.start() was not called")
        try:
            me = group.members.index(self.identity.public_key)
        except ValueError:
            raise LocalProtocolError("this peer is not a member of the group") from None
        if len(group.weights) != len(group.members):
            raise LocalProtocolError("the group has as many weights as members")
        if not isinstance(vector, torch.Tensor) or vector.numel() != group.numel or not vector.is_floating_point():
            raise LocalProtocolError(f"vector must be a float tensor of {group.numel} elements")
        if weight != group.weights[me]:
            raise LocalProtocolError(f"weight {weight} is not this member's weight in the group ({group.weights[me]})")
        if not sum(group.weights) > 0:
            raise LocalProtocolError("the group's weights must have a positive sum")
        if max(group.weights) > self.max_weight:
            raise LocalProtocolError(f"a weight in the group is over the run's limit of {self.max_weight:g} tokens")
        return me

    async def _wait(self, rnd: Round, done: Any, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while not done():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            rnd.changed.clear()  # nothing can arrive between done() and here: no await
            try:
                await asyncio.wait_for(rnd.changed.wait(), remaining)
            except asyncio.TimeoutError:
                return

    async def _wait_means(self, rnd: Round, deadline: float) -> None:
        """Until we hold every reduced part, or the deadline; or until each part we lack was
        reported held by another member ``ELSEWHERE_GRACE`` ago: its reducer sent it to the
        others and not (yet) to us. A reducer that withholds its part from one member would
        otherwise hold that member, and the agreement of the whole group, to the deadline; the
        agreement forwards the part now (and the reducer's own frames are still taken)."""
        loop = asyncio.get_running_loop()
        grace = ELSEWHERE_GRACE * rnd.group.deadline_s
        while not rnd.means_done():
            now = loop.time()
            until = min(deadline, rnd.held_elsewhere_at(grace))
            if now >= until:
                return
            rnd.changed.clear()  # nothing can arrive between means_done() and here: no await
            try:
                await asyncio.wait_for(rnd.changed.wait(), until - now)
            except asyncio.TimeoutError:
                pass

    async def _report(self, rnd: Round, i: int, frames: list[list[Any]]) -> None:
        """Send our report to member i; one we cannot reach is not waited for."""
        loop = asyncio.get_running_loop()
        try:
            left = rnd.agree_deadline - loop.time()
            nbytes = await asyncio.wait_for(self._send_frames(rnd.peer_ids[i], frames), max(left, 0.001))
            rnd.sent[0] += nbytes
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001  (as in _deliver: failing to reach a peer is its problem)
            log.info("report not delivered peer=%s detail=%r", rnd.peer_ids[i], e)
            rnd.gone.add(i)
            rnd.changed.set()

    async def _deliver(self, rnd: Round, j: int, frames: list[list[Any]], deadline: float, sent: list[int],
                       drop_on_failure: bool) -> None:
        """Send frames to member j by ``deadline``. A reducer we cannot reach will not reduce
        our slice nor send us its part: drop it at once rather than wait for it."""
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            if remaining <= 0:
                raise asyncio.TimeoutError
            nbytes = await asyncio.wait_for(self._send_frames(rnd.peer_ids[j], frames), remaining)
            sent[0] += nbytes  # not ``sent[0] += await ...``: that reads sent[0] before the await
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001  (any failure to reach a peer is that peer's problem)
            reason = "timeout" if isinstance(e, asyncio.TimeoutError) else f"unreachable:{type(e).__name__}"
            log.info("send failed reason=%s peer=%s detail=%s", reason, rnd.peer_ids[j], e)
            if drop_on_failure:
                rnd.drop(j, reason)
