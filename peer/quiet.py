"""Members that failed us in our last round with them get a short wait (``peer.allreduce``).

A key can join every group and then send nothing (a "ghost"), or push and then neither reduce
nor report. Nothing it does is a proven lie, and a timeout proves nothing, so it is not
banned; but every deadline of the round is there for an honest member that is late, and the
ghost would hold every group it is in to them (about ``deadline_s`` per sync, the push
deadline, or ``2.5 x`` for one that pushes and then falls silent).

So the averager remembers, per peer, whether it did its part in our last round with it: its
push of our slice came in time, its own reduced part reached us (or some member), and its
report came. A member that failed any of these there is *quiet*. In our next round with a
quiet member, each phase waits for it only a short while once every other member is done
with that phase (and at least one other member was): ``QUIET_GRACE x deadline_s``, or as long
again as the others took if that is longer. Then it is dropped as late, as at the deadline.

Why this cannot split honest members: what a member ends a round with never depended on how
long *it* waited. Members already drop a late member at different moments (their deadlines
start when each reaches the round), and the agreement that follows (``peer.allreduce_round``:
reports, forwarded parts, finals, ``conform``) gives them one result whatever each dropped.
This rule only makes one member's wait shorter, so it changes how often that happens, not
what happens. It needs a reference: with no other member done (a group of two, or we are
early and the others busy with their previous round), the quiet member gets the full wait,
so the phase lock of a shared round's end (``peer.matchmaking``) is never broken by it.

What it costs an honest member: one that failed a whole round with us (it missed the push
deadline, or its report never came) and is then late by more than the grace loses its
contribution to that round, as it would have at the deadline; one that is on time is not
touched, and ``CLEAR_AFTER`` whole rounds in a row clear the mark. A round in which we heard from no other
member (our own outage) marks nobody. A leader's false record can name an honest key in our
group that never joins it; that key is then quiet to us once, which costs it only this.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

__all__ = ["QUIET_GRACE", "QuietMembers", "grace"]

QUIET_GRACE = 0.1  # of deadline_s: how long a phase waits for quiet members once the others are done
CLEAR_AFTER = 3  # whole rounds in a row that clear a mark (one would let a ghost that does every other
# round cost a full deadline every other round)
MAX_QUIET = 4096  # peers remembered (the oldest marks go first)


def grace(deadline_s: float, elapsed: float) -> float:
    """How long a phase waits for its quiet members once every other member is done with it,
    ``elapsed`` seconds into the phase."""
    return max(QUIET_GRACE * deadline_s, elapsed)


class QuietMembers:
    """Peer IDs that failed their part in our last round with them (see the module docstring)."""

    def __init__(self, capacity: int = MAX_QUIET):
        self.capacity = capacity
        self._marks: OrderedDict[str, int] = OrderedDict()  # peer ID -> whole rounds since its last failure

    def __contains__(self, peer_id: str) -> bool:
        return peer_id in self._marks

    def __len__(self) -> int:
        return len(self._marks)

    def mark(self, peer_id: str) -> None:
        """Mark a peer quiet now: it failed its part before the round began (a leader of ours
        that wrote no group record, ``peer.matchmaking``)."""
        self._marks[peer_id] = 0
        self._marks.move_to_end(peer_id)
        while len(self._marks) > self.capacity:
            self._marks.popitem(last=False)

    def of(self, peer_ids: list[str], me: int) -> frozenset[int]:
        """The indices of a group's quiet members (``Round.quiet``)."""
        return frozenset(i for i, p in enumerate(peer_ids) if i != me and p in self._marks)

    def judge(self, rnd: Any) -> list[int]:
        """After a round: mark each member that failed its part in it (``failed``); count a whole
        round for the others that are marked, and clear those with ``CLEAR_AFTER`` in a row.
        Members banned for a lie are left alone (``peer.bans`` handles them), and so is every
        member of a round in which we heard from no other member. -> the indices marked."""
        heard = {i for i in range(rnd.n) if i != rnd.me and (rnd.pushed[i] or rnd.got[i] or i in rnd.reports
                                                               or i in rnd.finals)}
        marked = []
        for i in range(rnd.n):
            peer_id = rnd.peer_ids[i]
            if i == rnd.me or peer_id in rnd.banned or i in rnd.excluded or not heard - {i}:
                continue
            if failed(rnd, i):
                self.mark(peer_id)
                marked.append(i)
            elif peer_id in self._marks:
                self._marks[peer_id] += 1
                if self._marks[peer_id] >= CLEAR_AFTER:
                    del self._marks[peer_id]
        return marked


def failed(rnd: Any, i: int) -> bool:
    """Whether member i failed its part of a finished round as we saw it: its push of our slice
    did not come in time, its own part reached neither us nor (by the reports) anyone, or it
    never reported."""
    if rnd.size(rnd.me) and rnd.pushed_in_time[i] != rnd.size(rnd.me):
        return True
    if rnd.size(i) and not rnd.holds(i) and not any(r[i] for r in rnd.reports.values() if i < len(r)):
        return True
    return i not in rnd.reports and i not in rnd.finals
