"""The fragment syncs a node has in flight, and every transition they go through, without I/O.

Streaming DiLoCo starts fragment p's sync after inner step s and applies its result tau steps
later (``overlap``). Between the two the node may pause (what is in flight lands at once: it
is contributed, never dropped), download a newer state (only with nothing in flight), finish
(everything lands) or leave (everything is abandoned). The node used to key landings on the
schedule alone ("fragment p lands after step s + tau"), so a sync landed early by a pause was
looked up again at its landing step and the node crashed. Here a landing is decided by what
is in flight: a sync lands exactly once, at the first step at or after its landing step (or,
when the caller says its result is not there yet, at a later step, a bounded number of steps
on), or when drained; nothing else can land.

The object holds the caller's handle for each sync (a future, the delta, the weight) and
never looks inside it, so it is tested alone (tests/unit/test_sync_pipeline.py, with
hypothesis over random interleavings of all transitions).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from protocol.errors import LocalProtocolError
from protocol.fragments import SyncSchedule


@dataclass(frozen=True)
class Forming:
    """A sync whose group forms ahead of its start step (pipelined matchmaking): the node
    joined the round's matchmaking and will hand over its pseudo-gradient at ``starts_after``."""

    fragment: int
    round: int
    joined_after: int  # the inner step after which it joined
    starts_after: int  # the inner step after which its sync starts
    handle: Any  # the caller's: the group on its way, the weight it joined with


@dataclass(frozen=True)
class InFlight:
    """One fragment sync between its start and its landing."""

    fragment: int
    round: int
    started_after: int  # the inner step after which it started
    lands_after: int  # the inner step after which its result is due
    handle: Any  # the caller's: what it needs to land it


def late_allowance(schedule: SyncSchedule, late_share: float) -> int:
    """Steps past its landing step that a sync whose result is not there yet may stay in flight
    while the node trains on (``due``'s ``max_late``). None at tau = 0: DiLoCo without overlap
    applies every average at its sync step, so the node waits. With tau >= 1 the landing step
    is a floor: a member that reached the sync before the rest of its group (peers on shared
    or uneven hardware drift apart by several steps between two syncs) trains on instead of
    waiting for them, up to ``late_share`` of H in all (the run's ``sync.late_share``; 0.1 by
    default: Streaming DiLoCo loses little with overlaps of a few percent of H), and never past
    the next fragment's start (tau < H/P)."""
    if schedule.overlap == 0:
        return 0
    longest = min(int(schedule.inner_steps * late_share), schedule.inner_steps // schedule.fragments - 1)
    return max(0, longest - schedule.overlap)


class SyncPipeline:
    """The in-flight syncs of one node, keyed by fragment (one round of a fragment at a time).

    Transitions: ``joins(step, lead)`` says which rounds' groups to join ahead of their start
    (pipelined matchmaking) and ``form`` records one; ``starts(step)`` says which fragments
    start after an inner step (with their group forming, if any) and ``start`` records one;
    ``due(step, ready, max_late)`` hands back those whose landing step has come (and, with
    ``ready``, whose result is there, or whose fragment starts again now, or that are
    ``max_late`` steps overdue); ``take_forming()`` hands back
    the groups forming, for a pause to start them early; ``stop_before(r)`` says the node stops
    after round r - 1 (a finish, ``max_rounds``): no round from r on joins or starts from then
    on, and the groups forming for them are handed back to leave; ``drain()`` hands back all in flight (pause, finish);
    ``abandon()`` everything, for a node leaving without landing; ``rebase()`` after a state
    download, which is only allowed with nothing in flight, since the download replaces what
    a landing would apply to (a fast-forward also hands back the groups forming).
    """

    def __init__(self, schedule: SyncSchedule):
        self.schedule = schedule
        self._flight: dict[int, InFlight] = {}
        self._forming: dict[int, Forming] = {}
        self._started: dict[int, int] = {}  # fragment -> the latest round started (never started twice)
        self.closed = False  # finished or left: nothing starts any more
        self.last_round: int | None = None  # stop_before's: no round from this on joins or starts

    def __len__(self) -> int:
        return len(self._flight)

    def __bool__(self) -> bool:
        return bool(self._flight or self._forming)

    def __contains__(self, fragment: int) -> bool:
        return fragment in self._flight or fragment in self._forming

    def forming(self) -> list[Forming]:
        return sorted(self._forming.values(), key=lambda f: (f.starts_after, f.fragment))

    def in_flight(self) -> list[InFlight]:
        return sorted(self._flight.values(), key=lambda s: (s.started_after, s.fragment))

    def joins(self, step: int, lead: int) -> list[tuple[int, int, int]]:
        """(fragment, round, start step) of the syncs whose group should start forming after
        inner step ``step``: those that start within ``lead`` steps. ``lead`` is capped so that
        a fragment joins its next round only after its previous one has landed; 0 joins at
        the start step itself (no pipelining). No round from ``stop_before``'s on is joined."""
        sched = self.schedule
        lead = max(0, min(lead, sched.inner_steps - sched.overlap - 1))
        if self.closed or lead == 0:
            return []
        out = []
        for p in range(sched.fragments):
            if p in self._flight or p in self._forming:
                continue
            at = sched.next_start(p, step + 1)
            r = sched.round_of(p, at)
            if at - lead <= step and r > self._started.get(p, -1) and self._before_last(r):
                out.append((p, r, at))
        return out

    def form(self, fragment: int, round_: int, step: int, starts_after: int, handle: Any) -> Forming:
        if self.closed:
            raise LocalProtocolError("the sync pipeline is closed (the node finished or left)")
        if fragment in self:
            raise LocalProtocolError(f"fragment {fragment} round {round_} forms while a round of it is under way")
        if not self._before_last(round_):
            raise LocalProtocolError(f"fragment {fragment} round {round_} forms past the last round ({self.last_round - 1})")
        f = Forming(fragment, round_, step, starts_after, handle)
        self._forming[fragment] = f
        return f

    def starts(self, step: int) -> list[tuple[int, int, Forming | None]]:
        """(fragment, round, its group forming or None) of the syncs that start after inner
        step ``step``; a round already started (early, by a pause) is not started again. No
        round from ``stop_before``'s on starts, also when the last round of another fragment
        lands only at this step (a follower, a late landing) and the loop has not stopped yet."""
        if self.closed:
            return []
        out = []
        for p in self.schedule.starts_after(step):
            r = self.schedule.round_of(p, step)
            if r <= self._started.get(p, -1) or not self._before_last(r):
                continue
            f = self._forming.get(p)
            if f is not None and f.round != r:
                raise LocalProtocolError(f"fragment {p} formed round {f.round} but round {r} starts")
            out.append((p, r, self._forming.pop(p, None)))
        return out

    def stop_before(self, round_: int) -> list[Forming]:
        """The node stops after round ``round_ - 1`` (a finish, ``max_rounds``; the earliest such
        round counts): from now on no round from ``round_`` on joins or starts, and the groups
        forming for those rounds (joined before the stop was known) are removed and returned
        for the caller to leave, so that every finishing peer stops after the same round
        whether or not it had joined the next one yet. Rounds before it go on as they were."""
        self.last_round = round_ if self.last_round is None else min(self.last_round, round_)
        out = [f for f in self.forming() if not self._before_last(f.round)]
        for f in out:
            del self._forming[f.fragment]
        return out

    def _before_last(self, round_: int) -> bool:
        return self.last_round is None or round_ < self.last_round

    def take_forming(self) -> list[Forming]:
        """Remove and return the syncs whose group is forming: a pause or a finish starts them
        at once (the group counts on us), so their rounds are not started again later."""
        out = self.forming()
        self._forming.clear()
        return out

    def start(self, fragment: int, round_: int, step: int, handle: Any) -> InFlight:
        if self.closed:
            raise LocalProtocolError("the sync pipeline is closed (the node finished or left)")
        if fragment in self._flight or fragment in self._forming:
            old = self._flight.get(fragment) or self._forming[fragment]
            raise LocalProtocolError(f"fragment {fragment} round {round_} starts while its round {old.round} "
                                     f"is still under way")
        if round_ <= self._started.get(fragment, -1):
            raise LocalProtocolError(f"fragment {fragment} round {round_} was started already")
        if not self._before_last(round_):
            raise LocalProtocolError(f"fragment {fragment} round {round_} starts past the last round ({self.last_round - 1})")
        sync = InFlight(fragment, round_, step, step + self.schedule.overlap, handle)
        self._flight[fragment] = sync
        self._started[fragment] = round_
        return sync

    def due(self, step: int, ready: Callable[[InFlight], bool] | None = None,
            max_late: int | None = None) -> list[InFlight]:
        """Remove and return the syncs whose result is due after inner step ``step``. With
        ``ready``, a due sync for which it says False stays in flight (the caller trains on and
        lands it at a later step), unless its fragment's next round starts after ``step`` (a
        round lands before the next one of its fragment starts) or, with ``max_late``, it is
        that many steps past its landing step."""
        starting = set(self.schedule.starts_after(step))
        out = [s for s in self.in_flight() if s.lands_after <= step
               and (ready is None or s.fragment in starting or ready(s)
                    or (max_late is not None and step >= s.lands_after + max_late))]
        for s in out:
            del self._flight[s.fragment]
        return out

    def drain(self) -> list[InFlight]:
        """Remove and return every sync in flight, oldest first: a pause or a finish lands
        them now (contributed, not dropped). Start what is forming first (``take_forming``)."""
        if self._forming:
            raise LocalProtocolError(f"drained with groups forming (fragments {sorted(self._forming)})")
        out = self.in_flight()
        self._flight.clear()
        return out

    def abandon(self) -> list[InFlight | Forming]:
        """Leaving: remove and return everything under way (the caller cancels it), and close."""
        self.closed = True
        out: list[InFlight | Forming] = [*self.take_forming(), *self.in_flight()]
        self._flight.clear()
        return out

    def finish(self) -> list[InFlight]:
        """Finishing: everything in flight lands now, and nothing starts after it."""
        self.closed = True
        return self.drain()

    def rebase(self, *, keep_forming: bool) -> list[Forming]:
        """A downloaded state replaces the model: allowed only with nothing in flight, since a
        landing would apply a result to the replaced copy. A repair (same rounds) keeps the
        groups forming, which still want our next contribution; a fast-forward to later rounds
        returns them, removed, for the caller to cancel."""
        if self._flight:
            raise LocalProtocolError(f"a state download with syncs in flight (fragments {sorted(self._flight)})")
        if keep_forming:
            return []
        self._started.clear()  # the downloaded rounds say where each fragment is
        return self.take_forming()
