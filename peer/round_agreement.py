"""Agreement of one member's round (``peer.allreduce_round.Round``, phases 3-5 of its module
docstring): whose reports to wait for, which parts to ask for or forward, which disputes are
proven, and which parts to fall back on to follow the members that finished first. Pure
views of the round's state; the handler's intake (``peer.round_intake``) fills that state."""

from __future__ import annotations

import logging

log = logging.getLogger("peer.allreduce")

LATE = ("timeout", "short")
"""Reasons for which a member was dropped as late, not as a liar: its stream timed out, or
ended with its slice or part short. A late member may still send its part, and it may have
landed parts nobody else holds, so the agreement waits for its report."""


class AgreementMixin:
    """``Round``'s agreement views. Reads the round's state (``Round.__init__`` defines it):
    members, reports and finals, what we hold (``holds``, ``digests``), drops and bans."""

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
        round, but it may still have landed parts: without its report, or its final, we cannot tell), unless
        it is banned: a banned member's report is never waited for (``took_part``), and one that
        pushed nothing and reported nothing would have made every round it was in unagreed."""
        late = [i for i, why in self.dropped.items() if why.startswith(LATE) and self.peer_ids[i] not in self.banned]
        if not self.size(self.me):  # we reduce nothing (idle): nobody pushes to us, so we drop nobody as
            # late; the members no part we hold counted, and that did not report, are the reducers' late ones
            counted = {i for j, c in self.contributors.items() if self.holds(j) for i in c}
            late += [i for i in range(self.n) if i != self.me and i not in counted and i not in self.dropped
                     and i not in self.finals and self.peer_ids[i] not in self.banned]
        return (self.agreed() and all(i in self.reports or i in self.finals for i in late)
                and all(self.visible(j) for j in self.convicted))

    def kept(self, j: int) -> bool:
        """Whether we land part j although we hold proof that its reducer signed two means of
        it: the proof came after the reports, which showed one mean of the part (not
        ``visible``), and that mean is the one we hold. Every member that reported holding the
        part holds it, those that lacked it get it forwarded, and only some of them may ever
        see the proof (a second mean sent to us late, or handed on by a colluder): falling
        back on it would leave us apart from the rest. The reducer is banned all the same, the
        part is screened as any other, and the round is not ``settled``: the reports a member
        judges by came to it alone, and a liar with a colluder can show two members different
        ones, so the node compares states after the round."""
        return j in self.convicted and self.holds(j) and self.reported_mean(j) == self.digests()[j]

    def replaceable(self, j: int) -> bool:
        """Whether we hold proof against part j's reducer, the reports showed one mean of it,
        and we lack that mean (we hold the other one, which came first, or a piece of one):
        a forward of the reported mean is taken in place of what we hold (``accept_forwarded``),
        so that we land what the others land."""
        return j in self.convicted and (mean := self.reported_mean(j)) is not None and (
            not self.holds(j) or self.digests()[j] != mean)

    def thrown_out(self, j: int) -> bool:
        """Whether part j falls back because its reducer is proven to have equivocated on it
        (every member that holds the proof, unless it ``kept`` the part)."""
        return j in self.convicted and not self.kept(j)

    def visible(self, j: int) -> bool:
        """Whether the reports of members other than the part's reducer (ours as we sent it
        included) showed two means of part j: then every member that got them waited for the
        proof of it. A convicted reducer's own report counts for nothing: it could show one
        member another digest of its part than it shows the rest."""
        return len(self._means_shown(j)) > 1

    def reported_mean(self, j: int) -> bytes | None:
        """The one digest of part j that the reports of members other than its reducer (ours
        included) show; None when they show none, or two."""
        shown = self._means_shown(j)
        return next(iter(shown)) if len(shown) == 1 else None

    def _means_shown(self, j: int) -> set[bytes]:
        mine = self.reported[j] if self.reported else b""
        return {r[j] for i, r in self.reports.items() if i != j and r[j]} | ({mine} if mine else set())

    def _means_reported(self, j: int, mine: bytes) -> set[bytes]:
        """The distinct digests of part j in the members' reports and ``mine`` (b"": none)."""
        return {r[j] for r in self.reports.values() if r[j]} | ({mine} if mine else set())

    def wanted(self) -> list[int]:
        """Parts that we lack and another member reports holding, and ``replaceable`` ones."""
        return [j for j in range(self.n) if self.size(j) and (not self.holds(j) and j not in self.convicted
                                                              or self.replaceable(j))
                and any(r[j] for r in (*self.reports.values(), *self.finals.values()))]

    def came_late(self, j: int) -> bool:
        """Whether part j's reducer was late as this member saw it: we dropped it (its slice or
        part did not come in time, or a frame of its failed a check, or we could not reach it:
        its part, taken or forwarded, came to us apart from the round), or, for our own part, every other
        part we hold was reduced without our slice (it came too late to each of its reducers)."""
        if j != self.me:
            return j in self.dropped
        others = [c for k, c in self.contributors.items() if k != self.me and self.holds(k)]
        return bool(others) and all(self.me not in c for c in others)

    def conform(self) -> list[int]:
        """Parts we hold and fall back on, as members that finished before us did (their
        finals): a part whose reducer came late (``came_late``) that more members landed, or
        will land, without it than with our mean of it (``_tally``). The reducer of such a
        part produced it after those members had landed without it; landing it would leave us
        apart from them."""
        mine = self.digests()
        out = []
        for j in range(self.n):
            if not mine[j] or self.thrown_out(j) or not self.came_late(j):
                continue
            without, with_ = self._tally(j, mine[j])
            if without > with_:
                log.warning("falling back on a part the members that finished first landed without part=%d "
                            "reducer=%s without=%d with=%d group=%s", j, self.peer_ids[j], without, with_,
                            self.group.group_id.hex())
                out.append(j)
        return out

    def _tally(self, j: int, mine: bytes) -> tuple[int, int]:
        """(without, with) for part j, over the other believed members (``_believed``): a
        finished one by its final (one with another mean of the part counts for neither side);
        one not finished (its reducer aside, which lands its own part unless it too conforms)
        lands our mean if its report holds it, or if it sent no report yet and the part's
        reducer counted it (a contributor gets the part from its reducer); one whose report
        lacked the part got it late, if at all, and follows the same finals: neither side;
        nor does a contributor that sent no report and our report could not reach (gone).
        We count ourselves as the others count us, by our report (a member that left itself
        out fell back while the others counted it as landing the part: a review's repro).
        So the finals of members that finished cannot outvote members that will land the
        part: a liar that cut us from its own part (our own part then looks late) and says it
        landed without ours moves nobody while a member that got our part is still on its
        way; and every member judging the part counts the same finished members. The part's
        reducer never counts as landing without it: it decides when its part comes, so a final
        saying it fell back on its own part is no one else's view (a liar that held its part
        back, told one member in a final that it fell back on it, then handed that member the
        part, made it fall back while the members it forwarded the part to landed it, in most
        rounds: a review's repro; an honest reducer falls back on its own part only after
        others' finals did, and those count). Its final landing the part counts (as any
        member's: a liar's other final about that part cannot outvote it)."""
        without = with_ = 0
        for i in range(self.n):
            if i == self.me or not self._believed(i):
                continue
            final = self.finals.get(i)
            if final is not None:
                without += not final[j] and i != j
                with_ += final[j] == mine
            elif i != j:
                report = self.reports.get(i)
                if report is not None:
                    with_ += report[j] == mine
                elif i not in self.gone:  # (one our report could not reach, and that sent none, left)
                    with_ += i in self.contributors.get(j, ())
        if j != self.me and self.reported and self.reported[j] == mine:
            with_ += 1
        return without, with_

    def apart(self) -> list[int]:
        """Members (not banned) whose final says they landed other parts than we did."""
        return [i for i, f in self.finals.items() if self._believed(i) and f != self.landed]

    def _believed(self, i: int) -> bool:
        """Whether member i's final counts: not banned (nor proven a liar by our audits before
        we landed: ``Round.proven``), nor dropped from this round for a frame
        that failed a check (a lie; lateness, or a send of ours that failed, is none: a member
        we could not reach was not believed, so one that landed apart from us and told us so
        went unheard: a review's repro)."""
        return self.peer_ids[i] not in self.banned and i not in self.proven and self.dropped.get(i, "late").startswith(
            LATE + ("late", "unreachable"))

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
