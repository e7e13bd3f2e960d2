"""The fragment syncs a node has in flight, and every transition they go through, without I/O.

Streaming DiLoCo starts fragment p's sync after inner step s and applies its result tau steps
later (``overlap``). Between the two the node may pause (what is in flight lands at once: it
is contributed, never dropped), download a newer state (only with nothing in flight), finish
(everything lands) or leave (everything is abandoned). The node used to key landings on the
schedule alone ("fragment p lands after step s + tau"), so a sync landed early by a pause was
looked up again at its landing step and the node crashed. Here a landing is decided by what
is in flight: a sync lands exactly once, at the first step at or after its landing step, or
when drained; nothing else can land.

The object holds the caller's handle for each sync (a future, the delta, the weight) and
never looks inside it, so it is tested alone (tests/unit/test_sync_pipeline.py, with
hypothesis over random interleavings of all transitions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocol.errors import LocalProtocolError
from protocol.fragments import SyncSchedule


@dataclass(frozen=True)
class InFlight:
    """One fragment sync between its start and its landing."""

    fragment: int
    round: int
    started_after: int  # the inner step after which it started
    lands_after: int  # the inner step after which its result is due
    handle: Any  # the caller's: what it needs to land it


class SyncPipeline:
    """The in-flight syncs of one node, keyed by fragment (one round of a fragment at a time).

    Transitions: ``starts(step)`` says which fragments start after an inner step and
    ``start`` records one; ``due(step)`` hands back those whose landing step has come;
    ``drain()`` hands back all of them (pause, finish); ``abandon()`` too, for a node leaving
    without landing; ``rebase()`` after a state download, which is only allowed with nothing
    in flight, since the download replaces what a landing would apply to.
    """

    def __init__(self, schedule: SyncSchedule):
        self.schedule = schedule
        self._flight: dict[int, InFlight] = {}
        self.closed = False  # finished or left: nothing starts any more

    def __len__(self) -> int:
        return len(self._flight)

    def __bool__(self) -> bool:
        return bool(self._flight)

    def __contains__(self, fragment: int) -> bool:
        return fragment in self._flight

    def in_flight(self) -> list[InFlight]:
        return sorted(self._flight.values(), key=lambda s: (s.started_after, s.fragment))

    def starts(self, step: int) -> list[tuple[int, int]]:
        """(fragment, round) of the syncs that start after inner step ``step``."""
        if self.closed:
            return []
        return [(p, self.schedule.round_of(p, step)) for p in self.schedule.starts_after(step)]

    def start(self, fragment: int, round_: int, step: int, handle: Any) -> InFlight:
        if self.closed:
            raise LocalProtocolError("the sync pipeline is closed (the node finished or left)")
        if fragment in self._flight:
            old = self._flight[fragment]
            raise LocalProtocolError(f"fragment {fragment} round {round_} starts while its round {old.round} "
                                     f"is still in flight (started after step {old.started_after})")
        sync = InFlight(fragment, round_, step, step + self.schedule.overlap, handle)
        self._flight[fragment] = sync
        return sync

    def due(self, step: int) -> list[InFlight]:
        """Remove and return the syncs whose result is due after inner step ``step``."""
        ready = [s for s in self.in_flight() if s.lands_after <= step]
        for s in ready:
            del self._flight[s.fragment]
        return ready

    def drain(self) -> list[InFlight]:
        """Remove and return every sync in flight, oldest first: a pause or a finish lands
        them now (contributed, not dropped)."""
        out = self.in_flight()
        self._flight.clear()
        return out

    def abandon(self) -> list[InFlight]:
        """Leaving: remove and return everything in flight (the caller cancels it), and close."""
        self.closed = True
        return self.drain()

    def finish(self) -> list[InFlight]:
        """Finishing: everything in flight lands now, and nothing starts after it."""
        self.closed = True
        return self.drain()

    def rebase(self) -> None:
        """A downloaded state replaces the model (its step and rounds): allowed only with
        nothing in flight, since a landing would apply a result to the replaced copy."""
        if self._flight:
            raise LocalProtocolError(f"a state download with syncs in flight (fragments {sorted(self._flight)})")
