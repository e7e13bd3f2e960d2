"""Butterfly all-reduce of one fragment's flat fp32 vector among a formed group, over libp2p.

The arithmetic is ``protocol.butterfly``'s and must match ``peer.simulation.allreduce`` bit for
bit: member j reduces slice j. Every member encodes its slices with the group's codec and
pushes the foreign ones (``PushSlice``) to their reducers, and its own to its two witnesses
(``peer.round_witness``); reducer j accumulates in fp32, in member index order,
``weight_i / total * decode(slice_i)`` for every contributor i (its own slice as encoded too,
at its own index), each first scaled down to at most ``clip`` x the lower median
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
``weight`` = their summed weight), and sends its mean to them; also to a member it dropped as
late once that member's push comes after all (it is in the round, and would otherwise wait
for the part until its own means' deadline). Reduced parts must be in by ``1.5 * D``. Every send and
read is bounded by the deadlines, so no round can hang on a stalled or killed member.

Agreement (``peer.allreduce_round``). Then every member tells the others which parts it holds
(``PartsHeld``, a digest per part) and forwards the reducer's signed ``SliceAveraged`` frames
of a part it holds to a member that reports lacking it; a member takes a forwarded part once
one forwarder has sent all of it, checked as if its reducer had sent it. Each waits until
every member it knows took part has reported (``Round.took_part``: not one banned for a lie)
and it holds every part someone holds, or ``2.5 * D``. So a member that timed out on a part, or whose slice a reducer dropped as late (a
reducer sends its mean to its contributors, and members it banned, only), still ends the round with the part the
others hold: members that timed out on each other no longer land different averages. A
member keeps the parts of its finished rounds to answer a report that comes after it
finished (the last four, and older ones for two agreement windows within a byte budget:
``peer.inbox.keep_recent``). ``AllReduceOutcome.agreed`` says whether this member saw the agreement complete.

Screen (``peer.round_screen``). Before it lands, a member screens each other reducer's part by
the norms and dots the members reported: a mean its contributions cannot give is refused. A
refusal is not proof (a member's report to us alone may have lied), so a refused part is
audited at once (``peer.audit.Audits.before_landing``, up to ``SCREEN_AUDIT_WAIT * D`` more):
landed after all if its mean follows from the reducer's signed inputs, so one member's false
report cannot make us land apart from the others; fallen back on, its reducer convicted, if
not; a report that understated a push the audit shows convicts its sender
(``protocol.evidence.false_norm``).

Finals. A member that finishes sends every other member the parts it landed (a final
``PartsHeld``), and answers a report that comes after it finished with it. A member that
started so late that the others landed before its part existed (it was starved, or busy
with its previous round) falls back on its own part as they did (``Round.conform``), and
takes the parts they landed from their finished rounds: one result for the group, not a
repair rounds later. With its final a member relays the finals it got from the others, as
signed, and a final that comes after it landed naming other parts it relays to the group: two
finals one key signed for a round that name different parts are proof that it lied
(``protocol.evidence.contradicting_finals``; banned, and handed on: ``Audits.found``).

Fallback. A part that nobody reported holding by then (its reducer died, or failed every
member) holds *this member's own value* in the returned average, and is listed in
``AllReduceOutcome.fallback_parts``. ``peer.node``, whose vectors are pseudo-gradients,
replaces those parts with zeros (only the outer momentum moves that slice of the global copy),
which is the same on every surviving member, and keeps its local weights there unless its last
sync fell back there too: the inner steps' progress on them goes into its next pseudo-gradient
(``OuterFragment.carry``).

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
from collections.abc import Awaitable, Callable, Collection

import torch
from hivemind.p2p import P2P

from peer.allreduce_inbound import InboundMixin
from peer.allreduce_round import Round
from peer.allreduce_send import SendMixin, encode_chunks
from peer.allreduce_wait import WaitMixin
from peer.audit import Audits
from peer.inbox import PendingFrames, StreamEnded, StreamGate, keep_recent
from peer.quiet import DEADLINE_DROP, FINISHED_DROP, MEANS_DROP, QUIET_PUSH, QuietMembers
from peer.ratelimit import RateLimiter
from peer.signed_groups import SignedGroups
from protocol.butterfly import HEAD_ROOM, chunk_elements
from protocol.codecs import get_codec
from protocol.errors import LocalProtocolError
from protocol.identity import Identity, peer_id_from_public_key
from protocol.messages import MAX_FRAME_BYTES

__all__ = ["HANDLER_PREFIX", "AllReduceOutcome", "Averager", "Group", "chunk_elements"]

log = logging.getLogger(__name__)

HANDLER_PREFIX = "swarmstream-avg-v9-"  # v2: acknowledged frames (peer.outbox); v3: norms; v4: audits; v5: finals;
# v6: PushSlice.stopping; v7: PartsHeld.dots, and norms of the pushes as decoded; v8: witnesses (a reducer's own
# slice, encoded, to two members; SliceAveraged.own, PartsHeld.witness); v9: finals relayed (a v8 peer takes a
# final signed by another member than the stream's for a lie of the relayer's)
RESULT_GRACE = 0.5  # reduced parts are due by (1 + RESULT_GRACE) * deadline_s
AGREE_GRACE = 1.0  # reports and forwarded parts by (1 + AGREE_GRACE) * deadline_s
SCREEN_AUDIT_WAIT = 1.0  # x deadline_s: how long we wait, before landing, for the audits of parts the screen refused
ROUND_SPAN = 1 + RESULT_GRACE + AGREE_GRACE + SCREEN_AUDIT_WAIT
"""The longest a round may take, in all-reduce deadlines (3.5): its agreement's deadline, then the
audits of parts the screen refused. The node's landing and its run's-end settle wait that long."""
_RECENT_SPAN = 2  # finished rounds are kept this many agreement windows (2.5 D) for late reports (keep_recent)
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
    idle: tuple[int, ...] = ()
    """Members that reduce no slice (``GroupFormed.idle``: their slices are empty,
    ``protocol.butterfly.slice_bounds``)."""
    late: bool = False
    """We lead it and our record was stored after every member's deadline: nobody may have
    followed it, so a round in which we hear from nobody does not wait for them as if we were
    early (``Round.took_part``): a stalled leader of a pair waited 2.5 deadlines alone."""


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
    member that holds the proof, unless the reports showed one mean of it: ``Round.kept``,
    and then not agreed). False: compare states after the round."""
    clipped: tuple[int, ...] = ()
    """Members whose slice we scaled down, as the reducer of our part, because its norm was
    over ``clip`` x the lower median of the contributions' norms (protocol.butterfly)."""
    refused: tuple[bytes, ...] = ()
    """Public keys of the reducers whose mean we refused as too large for its contributions
    (``Round.implausible``) and could not audit before we landed (the node stops grouping with
    them). One we audited is judged by the audit (``peer.audit``): banned on a wrong mean,
    suspended if it never shows its inputs."""
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
    gated: tuple[int, ...] = ()
    """Members whose slice the direction gate took out of our part's mean (it pointed against
    the others' sum: ``protocol.gate.robust_factors``)."""


class Averager(InboundMixin, SendMixin, WaitMixin):
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
                 clip: float = 1.0, max_weight: float = 1e18, audit: float = 0.0, gate: bool = False):
        if not 2 * HEAD_ROOM <= max_frame_bytes <= MAX_FRAME_BYTES:
            raise LocalProtocolError(f"max_frame_bytes must be in [{2 * HEAD_ROOM}, {MAX_FRAME_BYTES}], "
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
        self.direction_gate = gate  # the run's sync.gate (protocol.gate.robust_factors)
        self.max_weight = max_weight  # the run's most tokens one sync may cover
        self.audits = Audits(self, audit, clip, gate)
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
        self.apart: deque[tuple[int, int, bytes]] = deque(maxlen=64)
        """(fragment, round, group ID) of rounds that said agreed, and a member's final that came
        after said it landed other parts: the node compares its state with the peers' (a repair)."""
        self.quiet = QuietMembers()
        """Peers that let us down in our last round with them (no push, no report or part, a bad
        frame): a short wait, and no slice in the groups we lead (``peer.quiet``)."""
        self.signed_groups: SignedGroups | None = None
        """The groups we signed frames in, on disk (``peer.signed_groups``; the node sets it):
        a group found there after a restart is not averaged in again."""

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

    # --- the all-reduce -----------------------------------------------------------------

    async def allreduce(self, group: Group, vector: torch.Tensor, weight: float, *,
                        stopping: bool = False) -> AllReduceOutcome:
        """Average ``vector`` (numel,) with the group's other members; see the module docstring.
        Never waits more than ``ROUND_SPAN * group.deadline_s`` (plus the local encode/decode):
        ``2.5 D`` when a member that took part never reports, plus ``SCREEN_AUDIT_WAIT * D``
        when the screen refused a part (its audit). ``stopping``: we pause, stop
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
        if self.signed_groups is not None:  # (peer.signed_groups: never two sets of signed frames for one group)
            if not self.signed_groups.reserve(gid) or not await asyncio.to_thread(self.signed_groups.write, gid):
                self._pending.pop(gid)
                self._finished.append(gid)  # its frames are dropped from now on, nothing signed answers them
                raise LocalProtocolError(f"group {gid.hex()} was averaged in before a restart, or could not be "
                                         "recorded: taking no part in it (another set of signed frames for it "
                                         "would read as a lie)")
        excluded = frozenset(i for i, key in enumerate(group.members) if peer_id_from_public_key(key) in self.banned)
        rnd = Round(group, me, vec, get_codec(group.codec), self.clip, excluded, self.banned,
                    chunk=chunk_elements(self.max_frame_bytes), gate=self.direction_gate)
        rnd.stopping = stopping
        rnd.quiet = self.quiet.of(rnd.peer_ids, me)
        rnd.grace_share = self.quiet.share(rnd.peer_ids, me)
        kept_waiting = self._pending.waited(gid, [p for i, p in enumerate(rnd.peer_ids) if i != me])
        self._active[gid] = rnd
        tasks, sent = rnd.tasks, rnd.sent
        try:  # (from here the round leaves _active however it ends)
            for peer_id, item, nbytes, data in self._pending.pop(gid):  # in arrival order
                if isinstance(item, StreamEnded):
                    rnd.stream_ended(peer_id, item.kind, item.part)
                elif isinstance(item, str):
                    if peer_id in rnd.index:
                        rnd.drop(rnd.index[peer_id], item)
                elif item.peer_id != peer_id:  # a final another member relayed
                    rnd.accept_relayed_final(peer_id, item, data)
                else:
                    rnd.accept(peer_id, item, nbytes, data)
            self._after_final(rnd, None)  # two finals of one member buffered before we started: proof
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
            if rnd.size(me):  # our own slice, as we will average it, and as our witnesses get it (after our
                # pushes: a witness that has not started the round buffers both, and needs our push more)
                s, e = rnd.bounds[me]
                own = encode_chunks(rnd, me, vec[s:e])
                rnd.own(own, self._frames(rnd, me, own, group.weights[me], None))
                for w in rnd.witnesses[me]:
                    tasks.append(asyncio.create_task(self._deliver(rnd, w, rnd.own_frames, push_deadline, sent, False)))
            await self._wait(rnd, rnd.pushes_done, push_deadline, rnd.pushes_done_but_quiet)
            phases = [loop.time() - t0]
            rnd.collecting_pushes = False
            silent = rnd.silent_quiet() if loop.time() < push_deadline else []
            for i in range(rnd.n):
                if i != me and i not in rnd.dropped and rnd.pushed[i] != rnd.size(me):
                    if i in silent:
                        rnd.cut.add(i)
                    rnd.drop(i, QUIET_PUSH if i in silent else DEADLINE_DROP)

            if rnd.size(me):
                mean, contrib, total = rnd.reduce()
                inputs = rnd.commit(contrib)
                encoded = self._encode(rnd, me, mean)
                frames = self._frames(rnd, me, encoded, total, contrib, inputs, rnd.own_digests())
                rnd.reduced(contrib, encoded, frames)
                rnd.end_deadline = end_deadline
                # a banned member on time is alive: it needs our part too; so does one dropped as late
                # whose push came after all (later ones get it when theirs comes: _send_mean_late)
                self._send_mean(rnd, set(contrib) | (rnd.excluded - rnd.dropped.keys()) | rnd.late_to_us())

            await self._wait_means(rnd, end_deadline)
            phases.append(loop.time() - t0)
            for j in range(rnd.n):
                if j != me and j not in rnd.dropped and rnd.got[j] != rnd.size(j):
                    rnd.drop(j, MEANS_DROP if loop.time() >= end_deadline
                             else FINISHED_DROP if j in rnd.finals
                             else "timeout:reduced part held by others, not sent to us")
            await self._agree(rnd)
            phases.append(loop.time() - t0)
            rnd.collecting_means = False
            while True:  # our sends, forwards answering reports that come meanwhile included, and the
                # finals of members a forward failed to reach (another forwarder's may have: Round.forwards)
                unsent = [t for t in tasks if not t.done()]
                left = rnd.agree_deadline - loop.time()
                if not (unsent or rnd.forwards_failed()) or left <= 0:
                    break
                rnd.changed.clear()  # a final sets it
                final = asyncio.ensure_future(rnd.changed.wait())
                await asyncio.wait([*unsent, final], timeout=left, return_when=asyncio.FIRST_COMPLETED)
                final.cancel()
            phases.append(loop.time() - t0)
            log.info("all-reduce phases pushes=%.3f means=%.3f agreed=%.3f sent=%.3f group=%s", *phases, gid.hex())
        except BaseException:  # cancelled (the node's landing timed out) or failed: kept, as frames only
            rnd.retire()
            rnd.result = rnd.result.new_empty(0)
            raise
        finally:
            # from here a report for this group is answered from the finished rounds' parts
            self._active.pop(gid, None)
            self._finished.append(gid)
            rnd.keep_until = loop.time() + _RECENT_SPAN * (1 + RESULT_GRACE + AGREE_GRACE) * group.deadline_s
            self._recent[gid] = rnd
            keep_recent(self._recent, loop.time())
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

        screened = [j for refused in rnd.screen() for j in refused]
        if screened:  # audited before we land: a false report to us alone may be why (Audits.before_landing)
            try:
                await self.audits.before_landing(rnd, screened, SCREEN_AUDIT_WAIT * group.deadline_s)
            except BaseException:  # cancelled while the audits ran: kept as frames only, as above
                rnd.retire()
                rnd.result = rnd.result.new_empty(0)
                raise
        landing = rnd.land()
        rnd.undelivered = rnd.forwards_undelivered()  # (its sends are done or cancelled by now)
        fallback, implausible, conformed = landing.fallback, landing.implausible, landing.conformed
        for i in self.quiet.judge(rnd):
            log.info("member silent through the round: a short wait for it next time peer=%s group=%s",
                     rnd.peer_ids[i], gid.hex())
        # our final to every member that has not told us it landed what we did: one that finished
        # first and said agreed learns from it that it was wrong (Averager._found_apart)
        self._tell_landed(rnd, [i for i in range(rnd.n) if i != me and rnd.finals.get(i) != rnd.landed
                                and i not in rnd.gone])
        for k in sorted(rnd.finals):  # a final naming other parts than we landed: to the whole group
            if rnd.finals[k] != rnd.landed and k not in rnd.proven:
                self._relay_final(rnd, k)
        self._after_final(rnd, None)  # proof found in the round (two finals of one member), if not acted on
        rnd.retire()
        self.audits.after(rnd, fallback, suspect=landing.inconsistent + rnd.unwitnessed())
        if rnd.undelivered:
            log.warning("parts forwarded to members that lacked them were not acknowledged in time forwards=%d: "
                        "they may land without them, so not agreed group=%s", rnd.undelivered, gid.hex())
        if landing.disputed:
            log.warning("members hold different means of one part parts=%s group=%s: its reducer sent "
                        "different ones", list(landing.disputed), gid.hex())
        offences, rnd.offences = tuple(rnd.offences.values()), {}  # the round is kept a while: not its evidence
        self.audits.hand_on(rnd, offences)
        self.audits.spread(rnd)
        result, rnd.result = rnd.result, rnd.result.new_empty(0)  # a finished round kept a while needs its frames
        rnd.said_agreed = (rnd.settled() and not landing.disputed and not rnd.apart() and self._finals_in(rnd, conformed)
                           and not rnd.undelivered and not rnd.unsure)
        return AllReduceOutcome(result, tuple(sorted(rnd.dropped)), fallback, sent[0], rnd.bytes_received,
                                time.perf_counter() - started, landing.partial, tuple(sorted(rnd.repaired)),
                                rnd.said_agreed,
                                tuple(rnd.clipped),
                                tuple(bytes(rnd.group.members[j]) for j in implausible if j not in rnd.audited),
                                offences, tuple(conformed),
                                kept_waiting, tuple(rnd.gated))

    @staticmethod
    def _finals_in(rnd: Round, conformed: Collection[int]) -> bool:
        """A round in which we fell back on parts to follow the finals of members that finished
        first (``Round.conform``) is agreed only once every other member's final is in (banned
        ones aside): one liar's final (its own part blanked) made a member fall back on a part
        the others landed, and every member said agreed (a review's repro)."""
        return not conformed or all(i in rnd.finals for i in range(rnd.n)
                                    if i != rnd.me and rnd.peer_ids[i] not in rnd.banned)

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
