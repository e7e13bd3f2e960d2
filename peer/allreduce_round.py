"""One member's state of one group's all-reduce (``peer.allreduce`` runs it), without I/O.

Fed by the averager's stream handler with verified frames, read by ``Averager.allreduce``;
``changed`` wakes the latter whenever something arrives. Three phases:

1. pushes: the members' encoded slices of our part (``PushSlice``), until all are in or the
   push deadline passes;
2. means: the reduced parts of the other reducers (``SliceAveraged``);
3. agreement: every member reports which parts it holds (``PartsHeld``, by digest); a member
   that lacks a part another holds gets that part's frames, as its reducer signed them,
   forwarded by a member that holds it (``forward_wanted`` says which). So a member that timed
   out on a part, or whose slice a reducer dropped as late (it sends its mean only to the
   contributors, and to members it banned), ends the round holding what the others hold; a part that nobody holds
   falls back on every member alike. Two members holding different digests of one part show
   that its reducer sent different means (``disputed``).
4. equivocation: a member that sees another report a digest of a part different from its own
   forwards that member its frames of the part, so each side ends up holding two different
   means signed by the reducer: proof (``protocol.evidence.equivocation``). A part so proven
   (``convicted``) falls back on every member that holds the proof, its reducer is banned, and
   the proof goes to every member that reported holding the part (``proof_wanted``). Until a
   reported dispute is proven, or the agreement's deadline, a member does not finish: honest
   members on both sides of a real equivocation hold the proof once their forwards arrive,
   and one member's false report proves nothing, so everyone keeps the part. A proof that
   the reports did not show (a second mean that reached one member late, or through a
   colluder) may reach some members only: ``visible`` is then False for that part, and the
   round is not ``settled``, so the node compares states after it.
5. finals: a member that finishes tells every other member which parts it landed
   (``PartsHeld`` with ``final``; b"" for a part it fell back on), and so does a finished
   member to one whose report comes after it finished. A member that started late (starved
   of CPU, busy with its previous round) may produce its part only after the others landed
   without it; it then holds a part they fell back on. Before it lands, it falls back on a
   part it holds when its reducer came late as it saw it and more finished members landed
   without the part than with it (``conform``). So the first finishers' decision stands, and
   the later ones follow it. A single member's final cannot make another fall back on a
   part that came on time, nor outvote an honest member that landed the part.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import msgpack
import torch

from protocol.butterfly import clip_scales, mean_norm_bound, screen_mean, slice_bounds, slice_norm
from protocol.audit import contribution_digest, inputs_digest
from protocol.codecs import Codec, get_codec
from protocol.envelope import Verified
from protocol.evidence import equivocation, offence
from protocol.errors import RemoteProtocolError
from protocol.identity import peer_id_from_public_key
from protocol.messages import digest
from protocol.messages_swarm import PartsHeld, PushSlice, SliceAveraged

MAX_OFFENCES = 4  # proven lies kept per round (one per signer), for peer.bans
LATE = ("timeout", "short")
"""Reasons for which a member was dropped as late, not as a liar: its stream timed out, or
ended with its slice or part short. A late member may still send its part, and it may have
landed parts nobody else holds, so the agreement waits for its report."""

log = logging.getLogger("peer.allreduce")

FP32 = get_codec("fp32")

Frame = list[Any]
"""One frame to send: the sealed envelope's parts (``protocol.envelope.seal_parts``), or the
received envelope's bytes as one part (to forward it unchanged)."""


def part_digest(contributors: tuple[int, ...], chunks: list[tuple[int, int, bytes]]) -> bytes:
    """Digest of a reduced part: its contributors and, in offset order, each chunk's offset,
    size and payload digest. Members that got the same signed frames compute the same one."""
    ordered = sorted(chunks)
    return digest(msgpack.packb([list(contributors), [[o, n, d] for o, n, d in ordered]], use_bin_type=True))


def _check_disjoint(chunks: list[tuple[int, int]], offset: int, numel: int) -> None:
    """A new chunk may not overlap one already received: every element comes exactly once,
    so "as many elements as the slice" means "all of the slice"."""
    for off, cnt in chunks:
        if offset < off + cnt and off < offset + numel:
            raise RemoteProtocolError(f"chunk [{offset}, {offset + numel}) overlaps one already received")


class Round:
    """One member's all-reduce of one group (see the module docstring)."""

    def __init__(self, group: Any, me: int, vector: torch.Tensor, codec: Codec, clip: float = 0.0,
                 excluded: frozenset[int] = frozenset(), banned: Any = frozenset()):
        self.group, self.me, self.codec, self.clip = group, me, codec, clip
        self.banned = banned
        """Peer IDs banned for a proven lie, as the node holds them now (a ban may come during
        the round): their reports are not waited for."""
        self.excluded = excluded - {me}
        """Members banned for a proven lie: we average none of their pushes (a reducer decides
        its contributors, so the others still land what we land). Their pushes are counted,
        and their lateness and reduced parts judged, like anyone's: a member that has not seen
        the evidence takes a banned reducer's part, and one that has must not wait longer for
        it than for anyone's (it waited until the means' deadline, 1.5 x the push deadline a
        late member gets, and the member that banned it first, having dropped it as late, ran
        seconds ahead of the others: on CI they then timed out on each other for rounds)."""
        self.n = len(group.members)
        self.bounds = slice_bounds(group.numel, self.n)
        self.peer_ids = [peer_id_from_public_key(k) for k in group.members]
        self.index = {p: i for i, p in enumerate(self.peer_ids)}
        self.vector = vector  # (numel,) fp32, our own values
        # of our slice of each part as its reducer sees it (our own raw, the others as we pushed
        # them: ``pushing``), reported
        self.norms = [slice_norm(vector[a:b]) for a, b in self.bounds]
        self.pushed_out: dict[int, torch.Tensor] = {}  # part -> our push of it, decoded (what its reducer averages)
        self.mean_errors: dict[int, dict[int, float]] = {}  # part -> offset -> squared error bound of that chunk
        self.dots: tuple[float, ...] = ()  # what our report said (``my_dots``)
        self.report_dots: dict[int, tuple[float, ...]] = {}  # member -> its dots, as it reported them
        self._seen: set[tuple] = set()  # (member, kind, part, offset, payload digest) of frames taken
        self.result = torch.empty(group.numel, dtype=torch.float32)
        self.dropped: dict[int, str] = {}  # member -> reason
        self.clipped: list[int] = []  # members whose slice we scaled down as too large
        # signed frames that failed a check and prove a lie (protocol.evidence): signer -> (key, why, frame)
        self.offences: dict[bytes, tuple[bytes, str, bytes | tuple[bytes, bytes]]] = {}
        self.convicted: dict[int, tuple[bytes, bytes]] = {}  # part -> two different means its reducer signed
        self.reported: tuple[bytes, ...] = ()  # the digests our PartsHeld said (empty before we report)
        self.proved: set[tuple[int, int]] = set()  # (member, part) we sent the proof of part's equivocation
        # pushes of our slice: sender -> [(offset, numel, payload)], and elements covered
        self.pushes: dict[int, list[tuple[int, int, Any]]] = {}
        # and as signed: sender -> [(offset, numel, payload digest, frame)], kept to show an auditor
        self.push_frames: dict[int, list[tuple[int, int, bytes, bytes]]] = {}
        self.own_chunks: list[tuple[int, int, bytes]] = []  # our own slice of our part, raw fp32, chunked
        self.pushed = [0] * self.n
        # reduced parts from the other reducers: elements covered and contributors seen
        self.got = [0] * self.n
        self.contributors: dict[int, tuple[int, ...]] = {}
        self.mean_chunks: dict[int, list[tuple[int, int, bytes]]] = {}  # part -> [(offset, numel, payload digest)]
        self.frames: dict[int, list[Frame]] = {}  # part -> its signed frames, to forward
        # agreement: reports by member, parts forwarded to us (part, forwarder) -> chunks
        self.reports: dict[int, tuple[bytes, ...]] = {}
        self.finals: dict[int, tuple[bytes, ...]] = {}  # member -> the parts it landed (its final report)
        self.landed: tuple[bytes, ...] = ()  # the parts we landed, once finished (our final report)
        self.told: set[int] = set()  # members we sent our final report
        self.report_norms: dict[int, tuple[float, ...]] = {}  # member -> its slices' norms, as it reported them
        self.held_since: dict[int, float] = {}  # part -> when a member other than its reducer first reported it held
        # (part, forwarder) -> [(offset, numel, frame, payload digest, contributors, payload)]
        self.repairs: dict[tuple[int, int], list[tuple[Any, ...]]] = {}
        self.repaired: set[int] = set()
        self.disputed: set[int] = set()
        self.forwarded: set[tuple[int, int]] = set()  # (member, part) we sent
        self.gone: set[int] = set()  # members our report could not reach: not waited for
        self.collecting_pushes = True
        self.collecting_means = True
        self.agreeing = False
        self.stopping = False  # we pause or finish: our pushes say we started early (PushSlice.stopping)
        self.early = False  # we had heard from no other member as our agreement began (took_part)
        self.bytes_received = 0
        self.sent = [0]  # bytes, added to by every send of this round
        self.tasks: list[asyncio.Task[None]] = []  # this round's sends
        self.agree_deadline = 0.0  # event-loop time
        self.changed = asyncio.Event()

    def size(self, j: int) -> int:
        s, e = self.bounds[j]
        return e - s

    # --- what the waiters ask -------------------------------------------------------------

    def pushes_done(self) -> bool:
        return all(i == self.me or i in self.dropped or self.pushed[i] == self.size(self.me) for i in range(self.n))

    def means_done(self) -> bool:
        return all(j == self.me or j in self.dropped or self.got[j] == self.size(j) for j in range(self.n))

    def held_elsewhere_at(self, grace: float) -> float:
        """When each part we lack will have been reported held by another member for ``grace``
        seconds (event-loop time); infinity while one of them is reported by nobody."""
        lacking = [j for j in range(self.n) if j != self.me and j not in self.dropped and self.size(j)
                   and not self.holds(j)]
        if not lacking or any(j not in self.held_since for j in lacking):
            return math.inf
        return max(self.held_since[j] for j in lacking) + grace

    def holds(self, j: int) -> bool:
        return self.size(j) > 0 and j in self.frames and self.got[j] == self.size(j)

    def digests(self) -> tuple[bytes, ...]:
        """Our ``PartsHeld`` report: each part's digest, b"" for parts we lack (or empty ones)."""
        return tuple(part_digest(self.contributors[j], self.mean_chunks[j]) if self.holds(j) else b""
                     for j in range(self.n))

    def took_part(self) -> list[int]:
        """The other members whose report we wait for: those we know are in this round (they
        pushed to us, sent us a part, or a reducer counted them, or reported); unless our
        report could not reach them, or they are banned for a lie (checked now: a ban may come
        during the round; a liar that comes late on purpose would have the members that still
        wait take its part and those done not). A member that sent nothing is not waited for
        (dead, paused, or in another group, it would hold every member to the agreement's
        deadline), except when we had heard from nobody as our agreement began
        (``early``): then we are more likely early than alone, the others busy with their
        previous round, and landing without them would have them take our part while we fall
        back on theirs."""
        counted = {i for j, c in self.contributors.items() if self.holds(j) for i in c}
        out = []
        for i in range(self.n):
            if i == self.me or i in self.gone or i in self.finals:  # finished: nothing more comes from it
                continue
            if i in self.reports:
                out.append(i)
            elif self.peer_ids[i] in self.banned:
                continue
            elif self.pushed[i] or self.got[i] or i in counted:
                out.append(i)
            elif self.early and (i not in self.dropped or self.dropped[i].startswith(LATE)):
                out.append(i)
        return out

    def heard_from_anyone(self) -> bool:
        counted = {i for j, c in self.contributors.items() if self.holds(j) for i in c}
        return any(i != self.me and (self.pushed[i] or self.got[i] or i in counted or i in self.reports)
                   for i in range(self.n))

    def agreed(self) -> bool:
        """Every member we wait for (``took_part``) has reported, we hold every part that any of them
        holds (the ones we lacked were forwarded to us), and every part reported with two
        different digests is proven to have been equivocated on."""
        if any(i not in self.reports for i in self.took_part()):
            return False
        return not self.wanted() and not self.unproven()

    def unproven(self) -> list[int]:
        """Parts for which two members (we included) report different digests, not (yet)
        proven to be two means signed by the reducer."""
        mine = self.digests()
        return [j for j in range(self.n) if j not in self.convicted and len(self._means_reported(j, mine[j])) > 1]

    def settled(self) -> bool:
        """What ``AllReduceOutcome.agreed`` says: the agreement completed, and every member we
        dropped as late reported too (one whose slices all came late took part in no one's
        round, but it may still have landed parts: without its report we cannot tell), unless
        it is banned: a banned member's report is never waited for (``took_part``), and one that
        pushed nothing and reported nothing would have made every round it was in unagreed."""
        late = [i for i, why in self.dropped.items() if why.startswith(LATE) and self.peer_ids[i] not in self.banned]
        return (self.agreed() and all(i in self.reports for i in late)
                and all(self.visible(j) for j in self.convicted))

    def visible(self, j: int) -> bool:
        """Whether the reports (ours as we sent it included) showed two means of part j: then
        every member that got them waited for the proof of it."""
        return len(self._means_reported(j, self.reported[j] if self.reported else b"")) > 1

    def _means_reported(self, j: int, mine: bytes) -> set[bytes]:
        """The distinct digests of part j in the members' reports and ``mine`` (b"": none)."""
        return {r[j] for r in self.reports.values() if r[j]} | ({mine} if mine else set())

    def wanted(self) -> list[int]:
        """Parts that we lack and another member reports holding."""
        return [j for j in range(self.n) if self.size(j) and not self.holds(j) and j not in self.convicted
                and any(r[j] for r in (*self.reports.values(), *self.finals.values()))]

    def came_late(self, j: int) -> bool:
        """Whether part j's reducer was late as this member saw it: we dropped it for
        lateness (its slice or part did not come in time), or, for our own part, every other
        part we hold was reduced without our slice (it came too late to each of its reducers)."""
        if j != self.me:
            return self.dropped.get(j, "").startswith(LATE)
        others = [c for k, c in self.contributors.items() if k != self.me and self.holds(k)]
        return bool(others) and all(self.me not in c for c in others)

    def conform(self) -> list[int]:
        """Parts we hold and fall back on, as members that finished before us did (their
        finals): a part whose reducer came late (``came_late``), which more finished members
        (not banned, nor dropped for a lie) landed without than with our mean of it. The
        reducer of such a part produced it after those members had landed without it;
        landing it would leave us apart from them."""
        mine = self.digests()
        finals = [f for i, f in self.finals.items() if self._believed(i)]
        out = []
        for j in range(self.n):
            if not mine[j] or j in self.convicted or not finals or not self.came_late(j):
                continue
            without = sum(1 for f in finals if not f[j])
            if without > sum(1 for f in finals if f[j] == mine[j]):
                log.warning("falling back on a part the members that finished first landed without part=%d "
                            "reducer=%s without=%d of=%d group=%s", j, self.peer_ids[j], without, len(finals),
                            self.group.group_id.hex())
                out.append(j)
        return out

    def apart(self) -> list[int]:
        """Members (not banned) whose final says they landed other parts than we did."""
        return [i for i, f in self.finals.items() if self._believed(i) and f != self.landed]

    def _believed(self, i: int) -> bool:
        """Whether member i's final counts: not banned, nor dropped from this round for a frame
        that failed a check (a lie, not lateness)."""
        return self.peer_ids[i] not in self.banned and self.dropped.get(i, "late").startswith(LATE + ("late",))

    def proof_wanted(self) -> list[tuple[int, int]]:
        """(member, part) pairs to send the proof of the part's equivocation to: every other
        member that reported holding the part (it may hold either mean)."""
        return [(i, j) for j in self.convicted for i, rep in self.reports.items()
                if rep[j] and i != j and (i, j) not in self.proved]

    def forward_wanted(self) -> list[tuple[int, int]]:
        """(member, part) pairs to forward now: the member reported lacking a part we hold, or
        holding another mean of it than ours (then our frames and its own prove the reducer
        equivocated)."""
        out = []
        mine = self.digests()
        for i, rep in self.reports.items():
            for j, d in enumerate(rep):
                if self.holds(j) and (i, j) not in self.forwarded and i != j and d != mine[j]:
                    out.append((i, j))
        return out

    # --- what the handler feeds -----------------------------------------------------------

    def drop(self, i: int, reason: str) -> None:
        if i == self.me or i in self.dropped:
            return
        self.dropped[i] = reason
        log.warning("dropped member reason=%s peer=%s group=%s index=%d", reason, self.peer_ids[i],
                    self.group.group_id.hex(), i)
        self.changed.set()

    def accept(self, peer_id: str, v: Verified, nbytes: int, data: bytes) -> None:
        """A verified frame whose signer is ``peer_id``, the stream's remote peer."""
        i = self.index.get(peer_id)
        if i is None:
            log.warning("rejected slice reason=not_a_member peer=%s group=%s", peer_id, self.group.group_id.hex())
            return
        if i == self.me:
            return
        msg = v.message
        if isinstance(msg, PartsHeld):  # also from a member we dropped: it may need our parts
            self._accept_report(i, msg)
            return
        late = self.dropped.get(i, "").startswith(LATE)
        if i in self.dropped and not (late and isinstance(msg, SliceAveraged)):
            return  # a member dropped for lateness may still send its part; not one that lied
        self.bytes_received += nbytes
        seen = (i, type(msg).__name__, msg.part, msg.offset, bytes(v.payload_digest))
        if seen in self._seen:
            return  # sent again because its acknowledgement did not come in time (peer.outbox)
        try:
            if isinstance(msg, PushSlice):
                self._accept_push(i, msg, v.payload_digest, data)
            else:
                self._accept_mean(i, msg, v.payload_digest, data)  # type: ignore[arg-type]
        except RemoteProtocolError as e:
            self.drop(i, f"{type(msg).__name__}:{e}")
            self._keep_evidence(data)
            return
        self._seen.add(seen)
        self.changed.set()

    def _keep_evidence(self, data: bytes) -> None:
        """Keep a frame that failed a check if it proves its signer lied: one per signer, a few
        per round (a frame wrong only for this round, or a resend, proves nothing and is not kept)."""
        if len(self.offences) >= MAX_OFFENCES:
            return
        proven = offence(data, self.group.run_id)
        if proven is not None and proven[0] not in self.offences:
            self.offences[proven[0]] = (proven[0], proven[1], bytes(data))

    def stream_ended(self, peer_id: str, kind: type) -> None:
        """A stream on which member ``peer_id`` sent its slice of ours (``PushSlice``) or its
        reduced part (``SliceAveraged``) ended. A sender writes all of it on one stream, so one
        still short now never completes: drop the sender at once rather than at the deadline."""
        i = self.index.get(peer_id)
        if i is None or i == self.me or i in self.dropped:
            return
        if kind is PushSlice and self.collecting_pushes and self.pushed[i] != self.size(self.me):
            self.drop(i, f"short:its stream ended after {self.pushed[i]} of the slice's {self.size(self.me)} elements")
        elif kind is SliceAveraged and self.collecting_means and not self.holds(i) and self.size(i):
            self.drop(i, f"short:its stream ended after {self.got[i]} of its part's {self.size(i)} elements")

    def accept_forwarded(self, forwarder: str, v: Verified, nbytes: int, data: bytes) -> None:
        """A ``SliceAveraged`` signed by its reducer, forwarded by another member because we
        reported lacking that part. Taken once one forwarder has sent all of the part."""
        f = self.index.get(forwarder)
        msg = v.message
        j = self.index.get(v.peer_id)
        if f is None or j is None or not isinstance(msg, SliceAveraged) or j == self.me:
            log.warning("rejected forwarded part reason=not_a_member peer=%s group=%s", forwarder,
                        self.group.group_id.hex())
            return
        if not self.agreeing:
            return  # unasked for
        if self.holds(j) or j in self.convicted:  # here already: the same mean, or proof of another
            held = [(o, n, self.contributors[j], d, f[0]) for (o, n, d), f in zip(self.mean_chunks[j], self.frames[j])
                    ] if self.holds(j) else []
            self._check_equivocation(j, msg, v.payload_digest, data, held)
            return
        if self._check_equivocation(j, msg, v.payload_digest, data,
                                    [(c[0], c[1], c[4], c[3], c[2]) for (p, _), cs in self.repairs.items() if p == j
                                     for c in cs]):
            return
        seen = (f, "forwarded", j, msg.offset, bytes(v.payload_digest))
        if seen in self._seen:
            return  # sent again because its acknowledgement did not come in time (peer.outbox)
        self._seen.add(seen)
        self.bytes_received += nbytes
        chunks = self.repairs.setdefault((j, f), [])
        try:
            self._check_mean(j, msg, sum(c[1] for c in chunks))
            _check_disjoint([(o, n) for o, n, *_ in chunks], msg.offset, msg.numel)
            if chunks and tuple(msg.contributors) != tuple(chunks[0][4]):
                raise RemoteProtocolError("contributors differ between chunks of one part")
            self.codec.decode(msg.payload, msg.numel)  # layout, scales and finiteness; raises
        except RemoteProtocolError as e:  # signed by the reducer: its fault, but we need not use it
            log.warning("rejected forwarded part reason=%s reducer=%s forwarder=%s group=%s", e,
                        self.peer_ids[j], forwarder, self.group.group_id.hex())
            self.repairs.pop((j, f), None)
            self._keep_evidence(data)  # evidence against its signer, the reducer
            return
        chunks.append((msg.offset, msg.numel, data, v.payload_digest, tuple(msg.contributors), msg.payload))
        if sum(c[1] for c in chunks) == self.size(j):
            self._take_repair(j, f)
        self.changed.set()

    def _check_equivocation(self, j: int, msg: SliceAveraged, payload_digest: bytes, data: bytes,
                            ours: list[tuple[int, int, tuple[int, ...], bytes, bytes]]) -> bool:
        """Whether ``data`` (``msg``), a frame of part j, and one of ``ours`` (offset, numel,
        contributors, payload digest, frame: each checked when it came) prove that j's reducer
        signed two different means; if so the part is convicted and the proof kept. Frames are
        compared by what ``part_digest`` covers first: the signatures are checked again only
        for a pair that overlaps and differs."""
        if j in self.convicted:
            return True
        what = (tuple(msg.contributors), payload_digest)
        for offset, numel, contributors, pd, frame in ours:
            if not (offset < msg.offset + msg.numel and msg.offset < offset + numel):
                continue
            if (offset, numel) == (msg.offset, msg.numel) and (tuple(contributors), pd) == what:
                continue  # the same mean
            proven = equivocation(bytes(frame), bytes(data), self.group.run_id)
            if proven is None:
                continue
            self.convicted[j] = (bytes(frame), bytes(data))
            log.warning("reducer equivocated part=%d peer=%s group=%s: two different means, signed; the part "
                        "falls back", j, self.peer_ids[j], self.group.group_id.hex())
            if len(self.offences) < MAX_OFFENCES and proven[0] not in self.offences:
                self.offences[proven[0]] = (proven[0], proven[1], self.convicted[j])
            self.changed.set()
            return True
        return False

    def _take_repair(self, j: int, f: int) -> None:
        chunks = self.repairs.pop((j, f))
        self.mean_errors[j] = {}
        for offset, numel, *_, payload in chunks:  # the whole part, from one forwarder's frames
            self.result[offset:offset + numel] = self.codec.decode(payload, numel)
            self.mean_errors[j][offset] = self.codec.error_bound(payload, numel) ** 2
        self.contributors[j] = tuple(chunks[0][4])
        self.mean_chunks[j] = [(c[0], c[1], c[3]) for c in chunks]
        self.frames[j] = [[c[2]] for c in chunks]
        self.got[j] = self.size(j)
        self.repaired.add(j)
        log.info("reduced part repaired part=%d from=%s group=%s", j, self.peer_ids[f], self.group.group_id.hex())

    def _accept_report(self, i: int, msg: PartsHeld) -> None:
        if len(msg.digests) != self.n:
            log.warning("rejected report reason=%d_parts_for_%d_members peer=%s", len(msg.digests), self.n,
                        self.peer_ids[i])
            return
        digests = tuple(bytes(d) for d in msg.digests)
        if msg.final:
            if i not in self.finals:
                self.finals[i] = digests
                if self.landed and digests != self.landed:
                    log.warning("a member landed other parts than we did peer=%s group=%s", self.peer_ids[i],
                                self.group.group_id.hex())
                self.changed.set()
            return
        if i in self.reports:
            return  # one report per member and round
        self.reports[i] = digests
        if len(msg.norms) == self.n:  # else it told us nothing about its slices: it bounds no part
            self.report_norms[i] = tuple(msg.norms)
        if len(msg.dots) == self.n:
            self.report_dots[i] = tuple(msg.dots)
        for j, d in enumerate(self.reports[i]):
            if d and j != i:
                self.held_since.setdefault(j, time.monotonic())  # the event loop's clock
        self.changed.set()

    def _check_slice(self, msg: PushSlice | SliceAveraged, part: int, covered: int) -> None:
        g = self.group
        s, e = self.bounds[part]
        if msg.codec != g.codec:
            raise RemoteProtocolError(f"codec {msg.codec} is not the group's {g.codec}")
        if msg.dtype != "float32" or tuple(msg.shape) != (msg.numel,):
            raise RemoteProtocolError(f"shape {tuple(msg.shape)} / dtype {msg.dtype} is not a flat float32 slice")
        if msg.numel == 0 or not (s <= msg.offset and msg.offset + msg.numel <= e):
            raise RemoteProtocolError(f"elements [{msg.offset}, {msg.offset + msg.numel}) are outside "
                                      f"slice {part} [{s}, {e})")
        if covered + msg.numel > e - s:
            raise RemoteProtocolError(f"more than the {e - s} elements of slice {part}")

    def _accept_push(self, i: int, msg: PushSlice, payload_digest: bytes, data: bytes) -> None:
        if msg.part != self.me:
            raise RemoteProtocolError(f"part {msg.part} sent to the reducer of part {self.me}")
        if not self.collecting_pushes:
            log.info("late slice ignored peer=%s group=%s", self.peer_ids[i], self.group.group_id.hex())
            return
        self._check_slice(msg, self.me, self.pushed[i])
        if msg.weight != self.group.weights[i]:
            raise RemoteProtocolError(f"weight {msg.weight} is not the group's {self.group.weights[i]}")
        chunks = self.pushes.setdefault(i, [])
        _check_disjoint([(off, cnt) for off, cnt, _ in chunks], msg.offset, msg.numel)
        if i in self.excluded:  # banned: counted (it came, on time or not), never averaged nor kept
            chunks.append((msg.offset, msg.numel, None))
            self.pushed[i] += msg.numel
            return
        self.codec.decode(msg.payload, msg.numel)  # layout, scales and finiteness; raises
        chunks.append((msg.offset, msg.numel, msg.payload))
        self.push_frames.setdefault(i, []).append((msg.offset, msg.numel, bytes(payload_digest), bytes(data)))
        self.pushed[i] += msg.numel

    def _check_mean(self, j: int, msg: SliceAveraged, covered: int) -> None:
        if msg.part != j:
            raise RemoteProtocolError(f"reduced part {msg.part} sent by the reducer of part {j}")
        self._check_slice(msg, j, covered)
        contrib = tuple(msg.contributors)
        if j not in contrib or contrib[-1] >= self.n:
            raise RemoteProtocolError(f"contributors {contrib} must include the reducer and be members")
        total = math.fsum(self.group.weights[c] for c in contrib)
        if not math.isclose(msg.weight, total, rel_tol=1e-9, abs_tol=1e-12):
            raise RemoteProtocolError(f"weight {msg.weight} is not the contributors' total {total}")

    def _accept_mean(self, j: int, msg: SliceAveraged, payload_digest: bytes, data: bytes) -> None:
        if self.holds(j):
            return  # forwarded to us already
        if not self.collecting_means:
            log.info("late reduced part ignored peer=%s group=%s", self.peer_ids[j], self.group.group_id.hex())
            return
        self._check_mean(j, msg, self.got[j])
        contrib = tuple(msg.contributors)
        if self.contributors.setdefault(j, contrib) != contrib:
            raise RemoteProtocolError("contributors differ between chunks of one part")
        _check_disjoint([(o, n) for o, n, _ in self.mean_chunks.setdefault(j, [])], msg.offset, msg.numel)
        decoded = self.codec.decode(msg.payload, msg.numel)  # raises on bad bytes or non-finite values
        self.result[msg.offset:msg.offset + msg.numel] = decoded
        self.mean_errors.setdefault(j, {})[msg.offset] = self.codec.error_bound(msg.payload, msg.numel) ** 2
        self.mean_chunks[j].append((msg.offset, msg.numel, payload_digest))
        self.frames.setdefault(j, []).append([bytes(data)])
        self.got[j] += msg.numel
        if self.agreeing and self.got[j] == self.size(j):
            self.repaired.add(j)  # resent by its reducer after our report said we lacked it

    def implausible(self) -> list[int]:
        """Parts we hold whose mean is larger than its contributors' reported norms allow
        (``protocol.butterfly.mean_norm_bound``): a reducer that scaled its mean up, or sent
        another, by much. Every member that holds the same frames and reports decides alike,
        and falls back on the part (a lie we cannot prove: the pushes are not ours to show,
        so no one is banned for it)."""
        norms = {**self.report_norms, self.me: self.norms}
        out = []
        for j in range(self.n):
            if not self.holds(j) or j in self.convicted:
                continue
            others = [i for i in self.contributors[j] if i != j] or [i for i in range(self.n) if i != j]
            bound = mean_norm_bound([norms[i][j] for i in others if i in norms], self.clip)
            s, e = self.bounds[j]
            if bound is not None and (norm := slice_norm(self.result[s:e])) > bound:
                log.warning("reduced part too large to be a mean of its contributions norm=%.3g bound=%.3g "
                            "part=%d reducer=%s group=%s: falling back on it", norm, bound, j, self.peer_ids[j],
                            self.group.group_id.hex())
                out.append(j)
        return out

    def pushing(self, j: int, encoded: list[tuple[int, int, bytes]]) -> None:
        """Our push of part j, encoded in chunks [(start, end, bytes)]: what its reducer will
        average, decoded, for our report's norm and dot of it."""
        s, e = self.bounds[j]
        out = torch.empty(e - s, dtype=torch.float32)
        for a, b, payload in encoded:
            out[a - s:b - s] = self.codec.decode(payload, b - a)
        self.pushed_out[j] = out
        self.norms[j] = slice_norm(out)

    def my_dots(self) -> tuple[float, ...]:
        """Our report's dots (``PartsHeld.dots``): for each part we hold and contributed to,
        ``<its mean, our push of it>`` in float64; 0.0 where we cannot say."""
        out = []
        for j in range(self.n):
            s, e = self.bounds[j]
            mine = self.pushed_out.get(j)
            known = (j != self.me and mine is not None and self.holds(j) and self.me in self.contributors[j])
            out.append(float(torch.dot(self.result[s:e].double(), mine.double())) if known else 0.0)
        self.dots = tuple(out)
        return self.dots

    def inconsistent(self) -> list[int]:
        """Parts we hold whose mean its contributions cannot give, by the members' reported
        norms and dots (``protocol.butterfly.mean_consistent``): negated, another vector, or
        scaled up beyond what the reducer's own slice allows. Every member that holds the same
        frames and reports decides alike and falls back on the part; the part is audited
        (``peer.audit``), which proves a wrong mean against its reducer (and bans it). One
        member's false report (a dot, a norm) cannot make an honest part fail: the screen
        refuses a mean only if it fits no world with one liar (``screen_mean``). Two colluding
        members can, so a refusal alone proves nothing: it distrusts and bans nobody (the audit
        decides), and costs that part's update for the round."""
        norms = {**self.report_norms, self.me: tuple(self.norms)}
        dots = {**self.report_dots, self.me: self.dots}
        out = []
        for j in range(self.n):
            if not self.holds(j) or j in self.convicted:
                continue
            others = [i for i in self.contributors[j] if i != j]
            # a contributor that did not report (or reported no norms) may be anything up to the clip
            said = {i: dots[i][j] if len(dots.get(i, ())) == self.n and dots[i][j] != 0.0 else None for i in others}
            s, e = self.bounds[j]
            # summed in offset order, so every member gets the same float whatever order the chunks came in
            error = math.sqrt(math.fsum(v for _, v in sorted(self.mean_errors[j].items()))) if j in self.mean_errors \
                else math.inf
            said_by = [(self.group.weights[i], norms[i][j] if i in norms else None, said[i]) for i in others]
            if not screen_mean(slice_norm(self.result[s:e]), error, self.clip, self.group.weights[j], said_by):
                log.warning("reduced part its contributions cannot give (by their reported dots) part=%d reducer=%s "
                            "group=%s: falling back on it", j, self.peer_ids[j], self.group.group_id.hex())
                out.append(j)
        return out

    # --- the reduction ------------------------------------------------------------------

    def retire(self) -> None:
        """The round is over: keep only what answering a late report needs (the parts' frames),
        and an audit of our part (its inputs)."""
        self.repairs.clear()
        self.pushes.clear()
        self.pushed_out.clear()
        if not self.own_chunks:
            self.push_frames.clear()
        self.vector = self.vector[:0]
        self.tasks = []

    def reduce(self) -> tuple[torch.Tensor, tuple[int, ...], float]:
        """Our slice's weighted mean over the members we have all of, in member order, each
        contribution scaled down to ``clip`` x the lower median norm first, as
        peer.simulation.allreduce does it. -> (fp32 mean, contributors, their total weight)."""
        me, (s, e) = self.me, self.bounds[self.me]
        contrib = tuple(i for i in range(self.n)
                        if i == me or (i not in self.dropped and i not in self.excluded and self.pushed[i] == e - s))
        total_w = float(sum(self.group.weights[i] for i in contrib))
        norms = [slice_norm(self.vector[s:e] if i == me else self._decoded(i)) for i in contrib]
        scales = clip_scales(norms, self.clip)
        acc = torch.zeros(e - s, dtype=torch.float32)
        for i, norm, scale in zip(contrib, norms, scales):
            if scale < 1.0:
                self.clipped.append(i)
                log.warning("clipped slice norm=%.3g bound=%.3g peer=%s group=%s", norm, scale * norm,
                            self.peer_ids[i], self.group.group_id.hex())
            w = self.group.weights[i] / total_w * scale
            if i == me:
                acc.add_(self.vector[s:e], alpha=w)
            else:
                for off, cnt, payload in sorted(self.pushes.get(i, ()), key=lambda c: c[0]):
                    self.codec.decode_add_(acc[off - s:off - s + cnt], payload, w)
        self.pushes.clear()  # the payloads are no longer needed
        return acc, contrib, total_w

    def commit(self, contrib: tuple[int, ...], chunks: list[tuple[int, int]]) -> bytes:
        """Our commitment to the inputs of our mean (``protocol.audit.inputs_digest``), our own
        slice cut at ``chunks`` ([start, end) of each frame); the inputs are kept to show a
        member that audits it."""
        me = self.me
        self.own_chunks = [(a, b - a, FP32.encode(self.vector[a:b])) for a, b in chunks]
        self.push_frames = {i: f for i, f in self.push_frames.items() if i in contrib}
        shares = []
        for i in contrib:
            key, w = bytes(self.group.members[i]), self.group.weights[i]
            chunks = ([(o, n, digest(p)) for o, n, p in self.own_chunks] if i == me
                      else [(o, n, d) for o, n, d, _ in self.push_frames[i]])
            shares.append(contribution_digest(key, w, chunks))
        return inputs_digest(shares)

    def _decoded(self, i: int) -> torch.Tensor:
        """Member i's push of our slice, decoded whole (for its norm)."""
        s, e = self.bounds[self.me]
        out = torch.empty(e - s, dtype=torch.float32)
        for off, cnt, payload in self.pushes[i]:
            out[off - s:off - s + cnt] = self.codec.decode(payload, cnt)
        return out

    def reduced(self, contrib: tuple[int, ...], encoded: list[tuple[int, int, bytes]], frames: list[Frame]) -> None:
        """Our own part, encoded and sealed: held like any other part (and forwarded alike)."""
        me = self.me
        self.mean_errors[me] = {}
        for a, b, payload in encoded:  # the mean exactly as the others decode it
            self.result[a:b] = self.codec.decode(payload, b - a)
            self.mean_errors[me][a] = self.codec.error_bound(payload, b - a) ** 2
        self.contributors[me] = contrib
        self.mean_chunks[me] = [(a, b - a, digest(payload)) for a, b, payload in encoded]
        self.frames[me] = frames
        self.got[me] = self.size(me)
