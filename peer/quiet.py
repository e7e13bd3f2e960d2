"""Members that let us down in our last round with them get a short wait (``peer.allreduce``).

A key can join every group and then send nothing at all (a "ghost"). Nothing it does is a
proven lie, and a timeout proves nothing, so it is not banned; but the push deadline is there
for an honest member that is late, and the ghost would hold every group it is in to it
(``deadline_s`` per sync, for good).

So the averager remembers the members from which no push of a round came while it waited
for them the whole push deadline (and it heard from another member of that round, or the
member acknowledged frames of ours: a round in which we heard nobody and nothing we sent was
taken, our own outage, marks nobody; in a group of two with a ghost we hear nobody every
round, but the ghost takes our pushes and report). Such a member is
*quiet*. In our next round with it, as long as no push of it has come in that round (to us,
or its own slice to us as its witness), the push phase waits for it only
``max(QUIET_GRACE x deadline_s, the others' time)`` once every other member has pushed (and at
least one has); then it is dropped as late, as at the deadline. A push from it in the meantime
restores the full wait. A report alone does not: one tiny frame per round would cost every
round the deadline again, and a member that reported is waited for in the agreement anyway.
The grace halves with each round in a row that we cut the member and heard nothing of it
since (no push in the round, no late push after it), down to ``1 / 2**MAX_HALVINGS`` of it
(``QuietMembers.share``; the most any quiet member of the group gets): a ghost cut round after
round cost every sync the whole grace, 2 s at the demo's deadline, for good. A member that
was only late is heard again when its push comes after the cut, and has the whole grace again.

Why this cannot split honest members: only a member no push of which has come in the round is
dropped early, and dropping it at the push phase is what the deadline does to a member that
has not started yet (members reach the round, so their deadlines, at different moments, and
the agreement that follows, ``peer.allreduce_round``, gives them one result whatever each
dropped). A quiet member that pushed has its late part dropped, or its report given up, only
after a grace once everyone else's is in (below), and such a round is never ``agreed``: the
nodes compare their states after it.
With no other member done while one that is not quiet is still to come (we may be early), the
quiet one gets the full wait, so the phase lock of a shared round's end (``peer.matchmaking``)
stays. When every other member is quiet (a pair with a ghost), nobody can show that we are
early rather than they silent, and each phase waits for them only the grace: such a pair cost
2.5 x deadline_s every round (a lagging node's rounds with a ghost took 50 s each at the demo's
pacing). A quiet partner that was only early lands what we landed when it comes (our final).

A member that pushes and then falls silent (no reduced part, no report: the ``hush`` lie)
would hold the means to ``1.5 x deadline_s`` and the agreement to ``2.5 x`` every round. So a
member whose report never came while the agreement waited its whole deadline for it, and
another member reported (in a pair: it acknowledged ours), is marked too. In our next rounds with it, once its part (if it has
one: a leader that holds it quiet gives it none, ``GroupFormed.idle``) or its report is all
that is missing, and another reducer's part or member's report is in, the wait for it is the
same grace; then its part is dropped as late, or its report given up (``Round.waived``). Such
a round is not ``agreed``: the nodes compare their states after it, as after any round in which
a member that took part did not report (it may have landed parts we did not).

A member that sent us a frame that failed a check (not proof of a lie, or it would be banned:
a chunk off its slice, say) is marked too: its slice would fall back in every round it sends
one bad frame in, so the groups we lead give it none.

Clearing. A round in which it pushes *and* reports (and sends nothing that fails a check)
counts towards clearing the mark (``CLEAR_AFTER`` of them); so does a push of a round it was
cut from that reaches us after the cut, in the round or after we finished it, covers its whole
slice and passes the checks (``Round.valid_late_push``: it was late, not gone; an honest member
that fell behind would otherwise be cut from every round and never catch the group's pace
again; a bogus late frame cleared a ghost's mark, and one valid chunk of many would clear it
for a few bytes). Only the finished rounds kept (``peer.inbox.keep_recent``)
can check such a push: one that comes later clears nothing. A
key that pushes in some rounds and is silent in the others costs a full deadline once every
``CLEAR_AFTER + 1`` rounds, and pushes (honest data, screened as anyone's) in the rest.

What it costs an honest member: one silent through a whole push deadline (frozen, or following
another record) and then, in the next rounds, late by more than the grace loses its
contribution to those rounds, as it would at the deadline; one on time is not touched. One
whose report came after a whole agreement deadline (starved of CPU) and then, in the next
rounds, reports later than the grace, is not waited for: if it landed a part we lack, it is
apart from us, and we (not agreed) compare states after the round; it is repaired when it
compares too (a round it lands that is not agreed), not before (docs/THREAT_MODEL.md).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from peer.round_agreement import LATE

__all__ = ["QUIET_GRACE", "QuietMembers", "grace"]

QUIET_GRACE = 0.1  # of deadline_s: how long the push phase waits for silent quiet members once the others pushed
MAX_HALVINGS = 3  # the grace halves with each round in a row a member was cut from unheard, down to 1/8 of it
CLEAR_AFTER = 3  # rounds it pushes in that clear a mark (one would let a ghost that pushes every other
# round cost a full deadline every other round)
MAX_QUIET = 4096  # peers remembered (the oldest marks go first)
MAX_CUT_ROUNDS = 64  # finished rounds whose cut members a late push still clears
DEADLINE_DROP = "timeout:slice not received in time"  # peer.allreduce's reason at the push deadline
MEANS_DROP = "timeout:reduced part not received in time"  # and at the means' deadline
FINISHED_DROP = "timeout:reduced part not sent to us, its reducer finished"  # (late: it may come forwarded)
QUIET_PUSH = "timeout:slice not received, quiet: silent in our last round with it too"  # a quiet member cut
QUIET_PART = "timeout:reduced part not received, quiet: silent in our last round with it too"  # in each phase


def grace(deadline_s: float, elapsed: float, share: float = 1.0) -> float:
    """How long a phase waits for its silent quiet members once every other member is done,
    ``elapsed`` seconds into it; ``share`` of the full grace (``QuietMembers.share``)."""
    return max(QUIET_GRACE * share * deadline_s, elapsed)


class QuietMembers:
    """Peers silent through our last round with them (see the module docstring)."""

    def __init__(self, capacity: int = MAX_QUIET):
        self.capacity = capacity
        self._marks: OrderedDict[str, int] = OrderedDict()  # peer ID -> rounds heard since it was marked
        self._streak: dict[str, int] = {}  # marked peer ID -> rounds in a row we cut it from and heard nothing of it
        self._cut: OrderedDict[bytes, set[str]] = OrderedDict()  # group ID -> quiet peers cut from it, unheard

    def __contains__(self, peer_id: str) -> bool:
        return peer_id in self._marks

    def __len__(self) -> int:
        return len(self._marks)

    def of(self, peer_ids: list[str], me: int) -> frozenset[int]:
        """The indices of a group's quiet members (``Round.quiet``)."""
        return frozenset(i for i, p in enumerate(peer_ids) if i != me and p in self._marks)

    def share(self, peer_ids: list[str], me: int) -> float:
        """The share of the full grace a round with these members waits for its quiet ones
        (``Round.grace_share``): halved for each round in a row that each of them was cut
        from with nothing heard of it since, ``MAX_HALVINGS`` times at most; the most that
        any of them gets. A ghost cut round after round costs each sync less and less; a push
        or late push of a member (``_heard``) gives it the whole grace again."""
        streaks = [self._streak.get(p, 0) for i, p in enumerate(peer_ids) if i != me and p in self._marks]
        return 0.5 ** min(min(streaks, default=0), MAX_HALVINGS)

    def judge(self, rnd: Any) -> list[int]:
        """After a round: mark each member no push came from while we waited the whole push
        deadline for it, or whose report did not come while we waited the agreement's, or that
        sent us a frame that failed a check; count a round for each marked one that pushed and
        reported, and clear it after ``CLEAR_AFTER``; leave one we cut or waived as it is.
        Members banned for a lie are left to ``peer.bans``; a round in which we heard no other
        member marks only members that acknowledged our frames (they are there, and read them:
        in a group of two with a ghost we hear nobody, every round). -> the indices marked."""
        marked = []
        for i in range(rnd.n):
            peer_id = rnd.peer_ids[i]
            if i == rnd.me or peer_id in rnd.banned or i in rnd.excluded or not (rnd.heard - {i} or i in rnd.acked):
                continue  # we heard nobody else, and it took none of our frames: our own outage, perhaps
            reported = i in rnd.reports or i in rnd.finals
            refused = i in rnd.dropped and not rnd.dropped[i].startswith((*LATE, "unreachable"))
            # we waited the means' whole deadline for its part, or it finished without sending us its
            # part and we asked for it (our report) through the agreement's whole deadline (a final
            # that claims a part it never sends held every round to 2.5 D: a review's repro); and
            # another reducer's part came (else we were late or cut off: a member that came after the
            # others had finished marked every reducer)
            no_part = not rnd.holds(i) and any(rnd.holds(j) for j in range(rnd.n) if j not in (i, rnd.me)) and (
                rnd.dropped.get(i) == MEANS_DROP or rnd.dropped.get(i) == FINISHED_DROP and rnd.agree_timed_out)
            if i in rnd.pushers and reported and not refused and rnd.size(i) and rnd.holds(i):  # all its part
                # (not an idle round: one that keeps its part to itself looks honest there)
                self._heard(peer_id)
            elif i in rnd.cut and i in rnd.pushers:  # its push came after we cut it, and passed the
                self._heard(peer_id)  # checks: late, not gone, as QuietMembers.late (its report came after
                # we finished: an honest member a grace late would otherwise be cut every round, for good)
            elif i in rnd.cut:
                self._cut.setdefault(bytes(rnd.group.group_id), set()).add(peer_id)
                if peer_id in self._marks:
                    self._streak[peer_id] = self._streak.get(peer_id, 0) + 1
            elif i in rnd.waived:
                pass  # still quiet: it pushed, and then let us down again
            elif rnd.dropped.get(i) == DEADLINE_DROP or refused or no_part or (  # we waited the whole push
                    # deadline for it, or it sent a bad frame, or we waited the means' whole deadline for its part
                    # and got another reducer's; or we waited the agreement's for its report, and another
                    # member reported (in a pair: it took ours)
                    i in rnd.pushers and not reported and i not in rnd.gone and rnd.agree_timed_out
                    and (any(j != i for j in rnd.reports) or (rnd.n == 2 and i in rnd.acked))):
                self._marks[peer_id] = 0
                self._marks.move_to_end(peer_id)
                self._streak.pop(peer_id, None)
                marked.append(i)
        while len(self._marks) > self.capacity:
            self._streak.pop(self._marks.popitem(last=False)[0], None)
        while len(self._cut) > MAX_CUT_ROUNDS:
            self._cut.popitem(last=False)
        return marked

    def late(self, group_id: bytes, peer_id: str) -> None:
        """A push of a round we finished came from ``peer_id``: if we had cut it from that
        round, it was late, not gone (counts as a round heard)."""
        cut = self._cut.get(bytes(group_id))
        if cut is not None and peer_id in cut:
            cut.discard(peer_id)
            self._heard(peer_id)

    def _heard(self, peer_id: str) -> None:
        self._streak.pop(peer_id, None)
        if peer_id in self._marks:
            self._marks[peer_id] += 1
            if self._marks[peer_id] >= CLEAR_AFTER:
                del self._marks[peer_id]
