"""One member's state of one group's all-reduce (``peer.allreduce`` runs it), without I/O.

Fed by the averager's stream handler with verified frames (``peer.round_intake``), read by
``Averager.allreduce``; ``changed`` wakes the latter whenever something arrives. The agreement's
views are ``peer.round_agreement``'s, the screen of reduced parts ``peer.round_screen``'s, our
own reduction ``peer.round_reduce``'s; this module holds the state and the waiters' questions.
Three phases:

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
   (``convicted``) falls back on every member that holds the proof (but see below), its reducer is banned, and
   the proof goes to every member that reported holding the part (``proof_wanted``). Until a
   reported dispute is proven, or the agreement's deadline, a member does not finish: honest
   members on both sides of a real equivocation hold the proof once their forwards arrive,
   and one member's false report proves nothing, so everyone keeps the part. A proof that
   the reports did not show (a second mean that reached one member late, or through a
   colluder: ``visible`` is False for that part, the reducer's own report left out) may
   reach some members only: each lands the one mean the reports of the others showed, as
   those it never reaches do (``kept``; one that holds the other mean, or a piece, takes a
   forward of the reported one in its place: ``replaceable``), and bans the reducer. Its
   round is not ``settled`` (a liar with a colluder can show two members different reports),
   so the node compares states after it.
5. finals: a member that finishes tells every other member which parts it landed
   (``PartsHeld`` with ``final``; b"" for a part it fell back on), and so does a finished
   member to one whose report comes after it finished. A member that started late (starved
   of CPU, busy with its previous round) may produce its part only after the others landed
   without it; it then holds a part they fell back on. Before it lands, it falls back on a
   part it holds when its reducer came late as it saw it and more members landed without the
   part than landed it or will (``conform``). So the first finishers' decision stands, and
   the later ones follow it. A single member's final cannot make another fall back on a part
   that came on time, nor outvote an honest member that landed the part or, other than the
   part's reducer, has yet to land it. Finals are relayed (``peer.allreduce_send``), and a
   second final of one member naming other parts proves it lied (``final_proofs``).
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any, NamedTuple

import msgpack
import torch

from protocol.butterfly import (chunk_elements, slice_bounds, slice_norm, witnessed,
                                witnesses_of)
from protocol.codecs import Codec
from protocol.identity import peer_id_from_public_key
from protocol.messages import MAX_FRAME_BYTES, digest

from peer.round_agreement import LATE, AgreementMixin
from peer.round_intake import MAX_OFFENCES, IntakeMixin
from peer.round_reduce import ReduceMixin
from peer.round_screen import ScreenMixin
from peer.round_witness import WitnessMixin

__all__ = ["LATE", "MAX_OFFENCES", "Frame", "Landing", "Round", "part_digest"]

log = logging.getLogger("peer.allreduce")

Frame = list[Any]
"""One frame to send: the sealed envelope's parts (``protocol.envelope.seal_parts``), or the
received envelope's bytes as one part (to forward it unchanged)."""


def part_digest(contributors: tuple[int, ...], chunks: list[tuple[int, int, bytes]], own: dict[int, bytes]) -> bytes:
    """Digest of a reduced part: its contributors and, in offset order, each chunk's offset,
    size, payload digest and ``own`` (the digest of the reducer's own slice's chunk it commits
    to, by offset). Members that got the same signed frames compute the same one."""
    ordered = sorted(chunks)
    return digest(msgpack.packb([list(contributors), [[o, n, d, own.get(o, b"")] for o, n, d in ordered]],
                                use_bin_type=True))


class Landing(NamedTuple):
    """What a member lands at the end of its round (``Round.land``)."""

    fallback: tuple[int, ...]
    """Parts whose elements keep our own values (``AllReduceOutcome.fallback_parts``)."""
    implausible: list[int]
    """Parts held and refused as larger than their contributions allow (``implausible``), not
    cleared by their audit before we landed (``cleared``)."""
    inconsistent: list[int]
    """Parts held and refused by the screen (``inconsistent``), not cleared likewise."""
    conformed: list[int]
    """Parts held and fallen back on to follow the members that finished first (``conform``)."""
    partial: tuple[int, ...]
    """Parts held that their reducer averaged without some member."""
    disputed: tuple[int, ...]
    """Parts another member reports holding another mean of, not proven equivocated."""


class Round(IntakeMixin, AgreementMixin, ScreenMixin, WitnessMixin, ReduceMixin):
    """One member's all-reduce of one group (see the module docstring)."""

    def __init__(self, group: Any, me: int, vector: torch.Tensor, codec: Codec, clip: float = 0.0,
                 excluded: frozenset[int] = frozenset(), banned: Any = frozenset(),
                 chunk: int = chunk_elements(MAX_FRAME_BYTES), gate: bool = False):
        self.group, self.me, self.codec, self.clip, self.gate = group, me, codec, clip, gate
        self.chunk = chunk
        """Elements per chunk of a slice (``protocol.butterfly.chunk_elements`` of the run's
        frame size): every slice's frames, ours and others', are on this grid."""
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
        self.bounds = slice_bounds(group.numel, self.n, group.idle)
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
        self.gated: list[int] = []  # members whose slice the direction gate took out of our mean
        # signed frames that failed a check and prove a lie (protocol.evidence): signer -> (key, why, frame)
        self.offences: dict[bytes, tuple[bytes, str, bytes | tuple[bytes, bytes]]] = {}
        self.convicted: dict[int, tuple[bytes, bytes]] = {}  # part -> two different means its reducer signed
        self.reported: tuple[bytes, ...] = ()  # the digests our PartsHeld said (empty before we report)
        self.proved: set[tuple[int, int]] = set()  # (member, part) we sent the proof of part's equivocation
        # pushes of our slice: sender -> [(offset, numel, payload)], and elements covered
        self.pushes: dict[int, list[tuple[int, int, Any]]] = {}
        # and as signed: sender -> [(offset, numel, payload digest, frame)], kept to show an auditor
        self.push_frames: dict[int, list[tuple[int, int, bytes, bytes]]] = {}
        # our own slice of our part as we average it: encoded in chunks [(offset, numel, bytes)], and
        # as the signed PushSlices our witnesses get (and an auditor); kept past the round once
        # our mean committed to it (``commit``), for an audit
        self.own_chunks: list[tuple[int, int, bytes]] = []
        self.own_frames: list[Frame] = []
        self.committed = False
        self.witnesses = [witnesses_of(j, self.n, group.group_id) if witnessed(self.n, clip) else ()
                          for j in range(self.n)]
        """Member j's witnesses (``protocol.butterfly.witnesses_of``; none in a group without)."""
        self.witnessing = tuple(j for j in range(self.n) if me in self.witnesses[j])  # the parts we witness
        # of each part we witness, its reducer's own slice: part -> [(offset, numel, payload, payload digest, frame)]
        self.witnessed: dict[int, list[tuple[int, int, bytes, bytes, bytes]]] = {j: [] for j in self.witnessing}
        self.mean_own: dict[int, dict[int, bytes]] = {}  # part -> offset -> its mean chunk's ``own``
        self.vouches: dict[int, dict[int, tuple[float, float]]] = {}  # part -> witness -> (norm, dot) it vouched
        self.pushed = [0] * self.n
        self.late_chunks: dict[int, set[tuple[int, int]]] = {}  # member -> its late push's chunks that passed
        self.quiet: frozenset[int] = frozenset()
        """Members that did not do their part in our last round with them (``peer.quiet``): no
        push, or no report. While no push of one has come in this round, the push phase waits
        for it only briefly once the others have pushed; so do the means phase for its reduced
        part and the agreement for its report, once everyone else's is in."""
        self.heard: set[int] = set()  # members a verified frame of this group came from
        self.mean_to: set[int] = set()  # members we sent our reduced part to
        self.end_deadline = math.inf  # the means' deadline (set when we reduced our part)
        self.grace_share = 1.0  # of the grace its waits give quiet members (``QuietMembers.share``)
        self.acked: set[int] = set()  # members that acknowledged frames of ours: reachable, reading (peer.quiet)
        self.pushers: set[int] = set()  # members a verified push of this group came from (to us, or witnessed)
        self.cut: set[int] = set()  # quiet members the push phase stopped waiting for (``peer.quiet``)
        self.waived: set[int] = set()  # quiet members whose reduced part or report we stopped waiting for
        self.agree_timed_out = False  # the agreement ran to its deadline (``peer.quiet`` marks who failed it)
        # reduced parts from the other reducers: elements covered and contributors seen
        self.got = [0] * self.n
        self.contributors: dict[int, tuple[int, ...]] = {}
        self.mean_chunks: dict[int, list[tuple[int, int, bytes]]] = {}  # part -> [(offset, numel, payload digest)]
        self.frames: dict[int, list[Frame]] = {}  # part -> its signed frames, to forward
        # agreement: reports by member, parts forwarded to us (part, forwarder) -> chunks
        self.reports: dict[int, tuple[bytes, ...]] = {}
        self.finals: dict[int, tuple[bytes, ...]] = {}  # member -> the parts it landed (its final report)
        self.landed: tuple[bytes, ...] = ()  # the parts we landed, once finished (our final report)
        self.said_agreed = False  # what our outcome said (a final that comes after it may belie it)
        self.told: set[int] = set()  # members we sent our final report
        self.final_frames: dict[int, bytes] = {}  # member -> its final as signed (from it, or relayed)
        self.relayed: set[int] = set()  # members whose final we relayed to the whole group
        self.relayed_to: set[tuple[int, int]] = set()  # (to, whose): finals we relayed, each once
        self.resent: dict[int, int] = {}  # member -> side sends to it that failed and went again
        # (member, what it did, the two finals it signed): found since the averager last looked
        self.final_proofs: list[tuple[int, str, tuple[bytes, bytes]]] = []
        self.report_norms: dict[int, tuple[float, ...]] = {}  # member -> its slices' norms, as it reported them
        self.report_frames: dict[int, bytes] = {}  # member -> its report as signed (peer.audit: a false norm)
        # part -> when two members other than its reducer had reported it held with one digest (one
        # member's report alone could make an honest reducer on its way look late: conform)
        self.held_since: dict[int, float] = {}
        self.holders: dict[tuple[int, bytes], set[int]] = {}  # (part, digest) -> members that reported it
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
        self.keep_until = math.inf  # (monotonic) kept to answer late reports until then (``inbox.keep_recent``)
        self.tasks: list[asyncio.Task[Any]] = []  # this round's sends
        # forwards of parts members reported lacking, (member, part, send): one not acknowledged by
        # the round's end may leave that member falling back on a part we land: not agreed
        self.forwards: list[tuple[int, int, asyncio.Task[bool]]] = []
        self.undelivered = 0  # how many of them (set as the round ends)
        self.agree_deadline = 0.0  # event-loop time
        self.changed = asyncio.Event()
        self.screened: tuple[list[int], list[int]] | None = None  # what the screens refused (``screen``)
        self.cleared: set[int] = set()
        """Parts the screen refused whose audit before we landed showed that the mean follows from
        its reducer's inputs (``peer.audit.Audits.before_landing``): landed after all."""
        self.audited: set[int] = set()  # parts audited before we landed (not again after the round)
        self.unsure = False  # a refused part's audit gave no verdict (yet) as we landed: another member may land it
        # members proven liars as we landed (by our audits before landing, or any proof we hold by then; set
        # when we audited): their finals count for nothing
        self.proven: set[int] = set()

    def size(self, j: int) -> int:
        s, e = self.bounds[j]
        return e - s

    # --- what the waiters ask -------------------------------------------------------------

    def pushes_done(self) -> bool:
        return all(i == self.me or i in self.dropped or self.pushed[i] == self.size(self.me) for i in range(self.n))

    def means_done(self) -> bool:
        return all(j == self.me or j in self.dropped or self.got[j] == self.size(j) for j in range(self.n))

    def lacking_finished(self) -> bool:
        """Every reduced part we still lack is of a reducer whose final is in: it finished
        without it reaching us (``Averager._wait_means``)."""
        lacking = [j for j in range(self.n) if j != self.me and j not in self.dropped and self.got[j] != self.size(j)]
        return bool(lacking) and all(j in self.finals for j in lacking)

    def silent_quiet(self) -> list[int]:
        """The quiet members no push has come from in this round (``peer.quiet``): a report
        alone does not restore the full wait (one tiny frame per round would cost every round
        the deadline again), and one that reported is waited for in the agreement anyway."""
        return [i for i in self.quiet if i not in self.pushers and i not in self.dropped]

    def forwards_undelivered(self) -> int:
        """How many of our forwards of parts we landed (``land`` first) may not have reached their
        member in time: its final, if in, shows the part landed as we did (then it got it, from
        us or another forwarder), or not; without its final, the send's acknowledgement is all
        we know. A part we fell back on in the end needs no forward."""
        mine = self.landed
        out = 0
        for i, j, task in self.forwards:
            if not mine[j]:
                continue
            if i in self.finals:
                out += self.finals[i][j] != mine[j]
            else:
                out += not task.done() or task.cancelled() or task.exception() is not None or not task.result()
        return out

    def forwards_failed(self) -> list[int]:
        """Members a forward of ours failed to reach whose final is not in: it may have got the
        part from another forwarder, which its final will show."""
        return sorted({i for i, _, task in self.forwards if i not in self.finals and task.done()
                       and (task.cancelled() or task.exception() is not None or not task.result())})

    def only_quiet_others(self) -> bool:
        """Every other member is quiet (``peer.quiet``): no member that is not could show that
        we are early rather than they silent (a group of two with a ghost in it would otherwise
        cost 2.5 D every round: a push, a means and an agreement deadline)."""
        return all(i in self.quiet for i in range(self.n) if i != self.me)

    def pushes_done_but_quiet(self) -> bool:
        """Some quiet member is still silent, every other member's push of our slice is in, and
        at least one other member pushed, or every other member is quiet (``peer.quiet``)."""
        silent = self.silent_quiet()
        size = self.size(self.me)
        rest = [i for i in range(self.n) if i != self.me and i not in self.dropped and i not in silent]
        return bool(silent) and all(self.pushed[i] == size for i in rest) and (
            any(self.pushed[i] for i in rest) or self.only_quiet_others())

    def means_done_but_quiet(self) -> list[int]:
        """The parts we still wait for when all are of quiet reducers and we hold another
        reducer's part, or every other member is quiet (``peer.quiet``); else []."""
        lacking = [j for j in range(self.n) if j != self.me and j not in self.dropped and self.got[j] != self.size(j)]
        if not lacking or any(j not in self.quiet for j in lacking):
            return []
        held = any(self.holds(j) for j in range(self.n) if j != self.me)
        return lacking if held or self.only_quiet_others() else []

    def agreed_but_quiet(self) -> bool:
        """The agreement is complete but for the reports of quiet members, and parts that only
        quiet members say they hold, and another member reported, or every other member is quiet
        (``peer.quiet``)."""
        waiting = [i for i in self.took_part() if i not in self.reports]
        if any(i not in self.quiet for i in waiting) or self.unproven():
            return False
        wanted = self.wanted()
        if not waiting and not wanted:
            return False  # complete (agreed)
        for j in wanted:  # a part we lack that only quiet members say they hold is not waited for
            if any(r[j] and i not in self.quiet for i, r in (*self.reports.items(), *self.finals.items())):
                return False
        return any(i != self.me and i not in waiting for i in self.reports) or self.only_quiet_others()

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
        return tuple(part_digest(self.contributors[j], self.mean_chunks[j], self.mean_own.get(j, {}))
                     if self.holds(j) else b""
                     for j in range(self.n))

    def late_to_us(self) -> set[int]:
        """Members we dropped as late whose push of this round came after all (to us, or to us
        as its witness, and passing the checks): in the round, and with no reduced part of ours
        coming, as they are no contributors (``Averager.allreduce`` sends it them)."""
        return {i for i in self.pushers if self.dropped.get(i, "").startswith(LATE)}

    def drop(self, i: int, reason: str, lie: bool = False) -> None:
        """Drop member i from the round for ``reason``; ``lie``: a frame of its failed a check,
        which turns a drop for lateness into one for a lie (a member that made itself late at
        will, then lied, would otherwise keep the say of a late member: ``_believed``)."""
        if i == self.me or (i in self.dropped and not (lie and self.dropped[i].startswith(LATE))):
            return
        self.dropped[i] = reason
        log.warning("dropped member reason=%s peer=%s group=%s index=%d", reason, self.peer_ids[i],
                    self.group.group_id.hex(), i)
        self.changed.set()

    def land(self) -> Landing:
        """Decide what we land, and write it into ``result``: our own values fill the parts we
        fall back on, which are a part nobody forwarded to us nor holds (its reducer failed
        every member alike); one whose reducer we proved sent different means (every member
        that holds the proof, unless it ``kept`` the part); one far larger than its contributions allow, or refused by the
        screen (``screen``), unless its audit before we landed passed (``cleared``: the
        refusal is not proof, a member's report to us alone may have lied); or a
        late reducer's part that the members which finished first landed without. Sets
        ``landed``, our final report."""
        implausible, inconsistent = ([j for j in refused if j not in self.cleared] for refused in self.screen())
        conformed = self.conform()
        fallback = tuple(j for j in range(self.n) if self.size(j) and (
            not self.holds(j) or self.thrown_out(j) or j in implausible or j in inconsistent or j in conformed))
        for j in fallback:
            s, e = self.bounds[j]
            self.result[s:e] = self.vector[s:e]
        partial = tuple(j for j, contrib in sorted(self.contributors.items())
                        if self.holds(j) and len(contrib) < self.n)
        mine = self.digests()
        disputed = tuple(j for j in range(self.n) if j not in self.convicted
                         and mine[j] and any(r[j] and r[j] != mine[j] for r in self.reports.values()))
        self.landed = tuple(b"" if j in fallback else mine[j] for j in range(self.n))
        return Landing(fallback, implausible, inconsistent, conformed, partial, disputed)

    # --- the reduction ------------------------------------------------------------------

    def retire(self) -> None:
        """The round is over: keep only what answering a late report needs (the parts' frames),
        and an audit of our part (its inputs)."""
        self.repairs.clear()
        self.pushes.clear()
        self.pushed_out.clear()
        self.witnessed = {j: [] for j in self.witnessing}
        if not self.committed:
            self.push_frames.clear()
            self.own_chunks, self.own_frames = [], []
        self.vector = self.vector.new_empty(0)  # (a view would keep all of it)
        self.tasks = []

    def reduced(self, contrib: tuple[int, ...], encoded: list[tuple[int, int, bytes]], frames: list[Frame]) -> None:
        """Our own part, encoded and sealed: held like any other part (and forwarded alike)."""
        me = self.me
        self.mean_errors[me] = {}
        for a, b, payload in encoded:  # the mean exactly as the others decode it
            self.result[a:b] = self.codec.decode(payload, b - a)
            self.mean_errors[me][a] = self.codec.error_bound(payload, b - a) ** 2
        self.contributors[me] = contrib
        self.mean_chunks[me] = [(a, b - a, digest(payload)) for a, b, payload in encoded]
        self.mean_own[me] = self.own_digests()
        self.frames[me] = frames
        self.got[me] = self.size(me)
