"""The sans-IO sync pipeline: every fragment sync lands exactly once (or is abandoned on leave),
never before its landing step unless a pause or finish drains it, one round of a fragment at
a time; checked over random interleavings of steps, pauses, resumes, downloads, finish and
leave (hypothesis stateful testing), and the old pause/resume crash replayed."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from peer.sync_pipeline import SyncPipeline
from protocol.errors import LocalProtocolError
from protocol.fragments import SyncSchedule


def test_a_pause_between_start_and_landing_then_resume_lands_each_sync_once():
    """The old crash: fragment 0 starts after step 2 (H=4, P=2, tau=1), a pause lands it at
    once, and after the resume its landing step (3) came and the node looked it up again."""
    pipe = SyncPipeline(SyncSchedule(inner_steps=4, fragments=2, overlap=1))
    assert pipe.starts(1) == []
    assert pipe.starts(2) == [(0, 0)]
    pipe.start(0, 0, 2, "h0")
    assert [s.handle for s in pipe.drain()] == ["h0"]  # the pause lands it now
    assert pipe.due(3) == []  # its landing step: nothing to land, no crash
    assert pipe.starts(4) == [(1, 0)]
    pipe.start(1, 0, 4, "h1")
    assert pipe.due(4) == []
    assert [(s.fragment, s.round) for s in pipe.due(5)] == [(1, 0)]


def test_a_download_with_syncs_in_flight_and_a_second_round_of_a_fragment_in_flight_are_refused():
    pipe = SyncPipeline(SyncSchedule(inner_steps=4, fragments=1, overlap=2))
    pipe.start(0, 0, 4, None)
    with pytest.raises(LocalProtocolError, match="in flight"):
        pipe.rebase()
    with pytest.raises(LocalProtocolError, match="still in flight"):
        pipe.start(0, 1, 8, None)
    pipe.drain()
    pipe.rebase()


def test_finish_lands_what_is_in_flight_and_nothing_starts_after_it():
    pipe = SyncPipeline(SyncSchedule(inner_steps=4, fragments=2, overlap=1))
    pipe.start(0, 0, 2, "a")
    assert [s.handle for s in pipe.finish()] == ["a"]
    assert pipe.starts(4) == [] and not pipe
    with pytest.raises(LocalProtocolError, match="closed"):
        pipe.start(1, 0, 4, "b")


class Pipeline(RuleBasedStateMachine):
    """A node's life, driven at random: what the node loop does with the pipeline at each event."""

    def __init__(self):
        super().__init__()
        self.pipe: SyncPipeline | None = None
        self.step = 0
        self.paused = False
        self.started: dict[int, tuple[int, int, int]] = {}  # id -> (fragment, round, landing step)
        self.ended: dict[int, str] = {}  # id -> how it ended: landed, drained, abandoned
        self.next_id = 0

    @initialize(H=st.integers(2, 12), P=st.integers(1, 4), tau=st.integers(0, 5), first=st.integers(0, 30))
    def make(self, H, P, tau, first):
        P = min(P, H)
        tau = 0 if tau >= H // P else tau
        self.schedule = SyncSchedule(inner_steps=H, fragments=P, overlap=tau)
        self.pipe = SyncPipeline(self.schedule)
        self.step = first

    def _land(self, syncs, how: str) -> None:
        for s in syncs:
            assert s.handle not in self.ended, f"sync {s.handle} ended twice"
            self.ended[s.handle] = how

    @rule()
    @precondition(lambda self: self.pipe is not None and not self.paused and not self.pipe.closed)
    def inner_step(self):
        self.step += 1
        for p, r in self.pipe.starts(self.step):
            assert p not in self.pipe  # tau < H/P: a fragment's round ends before its next starts
            self.pipe.start(p, r, self.step, self.next_id)
            self.started[self.next_id] = (p, r, self.step + self.schedule.overlap)
            self.next_id += 1
        due = self.pipe.due(self.step)
        for s in due:
            assert s.lands_after <= self.step and self.started[s.handle][2] == s.lands_after
        self._land(due, "landed")

    @rule()
    @precondition(lambda self: self.pipe is not None and not self.paused and not self.pipe.closed)
    def pause(self):
        self._land(self.pipe.drain(), "drained")
        self.paused = True

    @rule()
    @precondition(lambda self: self.paused)
    def resume(self):
        self.paused = False

    @rule(to=st.integers(0, 60))
    @precondition(lambda self: self.pipe is not None and not self.pipe.closed)
    def download(self, to):
        """A state download: the node does it only between rounds (nothing in flight) or paused."""
        if self.pipe:
            with pytest.raises(LocalProtocolError):
                self.pipe.rebase()
            return
        self.pipe.rebase()
        self.step = max(self.step, to)

    @rule()
    @precondition(lambda self: self.pipe is not None and not self.pipe.closed)
    def finish(self):
        self._land(self.pipe.finish(), "drained")

    @rule()
    @precondition(lambda self: self.pipe is not None and not self.pipe.closed)
    def leave(self):
        self._land(self.pipe.abandon(), "abandoned")

    @rule(later=st.integers(1, 40))
    @precondition(lambda self: self.pipe is not None and self.pipe.closed)
    def after_the_end(self, later):
        """Once finished or left, no step starts a sync and nothing is due."""
        assert self.pipe.starts(self.step + later) == [] and self.pipe.due(self.step + later) == []

    @invariant()
    def every_sync_is_in_flight_or_ended_once(self):
        if self.pipe is None:
            return
        flying = {s.handle for s in self.pipe.in_flight()}
        assert flying.isdisjoint(self.ended)
        assert flying | set(self.ended) == set(self.started)
        fragments = [s.fragment for s in self.pipe.in_flight()]
        assert len(fragments) == len(set(fragments))
        assert all(s.lands_after > self.step for s in self.pipe.in_flight())  # nothing overdue is kept
        if self.pipe.closed or self.paused:
            assert not self.pipe


Pipeline.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestPipeline = Pipeline.TestCase
