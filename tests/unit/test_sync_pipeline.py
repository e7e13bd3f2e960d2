"""The sans-IO sync pipeline: every fragment sync lands exactly once (or is abandoned on leave),
never before its landing step unless a pause or finish drains it, one round of a fragment at
a time; checked over random interleavings of steps, pauses, resumes, downloads, finish and
leave (hypothesis stateful testing), and the old pause/resume crash replayed."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from peer.sync_pipeline import late_allowance, SyncPipeline
from protocol.errors import LocalProtocolError
from protocol.fragments import SyncSchedule


def test_a_pause_between_start_and_landing_then_resume_lands_each_sync_once():
    """The old crash: fragment 0 starts after step 2 (H=4, P=2, tau=1), a pause lands it at
    once, and after the resume its landing step (3) came and the node looked it up again."""
    pipe = SyncPipeline(SyncSchedule(inner_steps=4, fragments=2, overlap=1))
    assert pipe.starts(1) == []
    assert pipe.starts(2) == [(0, 0, None)]
    pipe.start(0, 0, 2, "h0")
    assert [s.handle for s in pipe.drain()] == ["h0"]  # the pause lands it now
    assert pipe.due(3) == []  # its landing step: nothing to land, no crash
    assert pipe.starts(4) == [(1, 0, None)]
    pipe.start(1, 0, 4, "h1")
    assert pipe.due(4) == []
    assert [(s.fragment, s.round) for s in pipe.due(5)] == [(1, 0)]


def test_a_sync_whose_result_is_not_there_waits_past_its_landing_step_but_not_past_its_next_start():
    """A node that follows the others (peer.pace) trains on when a result is late: with
    ``ready``, a due sync stays in flight until ready says so, or until its fragment starts
    its next round (a round lands before the next one of its fragment starts)."""
    pipe = SyncPipeline(SyncSchedule(inner_steps=4, fragments=1, overlap=1))
    pipe.start(0, 0, 4, "h0")
    assert pipe.due(5, ready=lambda s: False) == []  # due, not there: train on
    assert pipe.due(6, ready=lambda s: False) == []
    assert [s.handle for s in pipe.due(8, ready=lambda s: False)] == ["h0"]  # round 1 starts after 8
    pipe.start(0, 1, 8, "h1")
    assert [s.handle for s in pipe.due(9, ready=lambda s: s.handle == "h1")] == ["h1"]
    assert pipe.due(10) == []


def test_with_overlap_a_late_result_lands_when_it_is_there_or_max_late_steps_on():
    """Any node with tau >= 1 trains on past a landing step whose result is not there, at most
    ``late_allowance`` steps: a tenth of H in all, and before the next fragment's start."""
    schedule = SyncSchedule(inner_steps=100, fragments=2, overlap=1)
    assert late_allowance(schedule, 0.1) == 9  # tau 1 + 9 = 10 = H / 10
    assert late_allowance(schedule, 0.0) == 0  # the run says: always at s + tau
    assert late_allowance(SyncSchedule(inner_steps=100, fragments=2, overlap=0), 0.1) == 0  # DiLoCo waits
    assert late_allowance(SyncSchedule(inner_steps=40, fragments=10, overlap=1), 0.5) == 2  # H/P - 1 = 3 in all
    assert late_allowance(SyncSchedule(inner_steps=100, fragments=2, overlap=12), 0.1) == 0
    pipe = SyncPipeline(schedule)
    pipe.start(0, 0, 50, "h0")
    for step in range(51, 60):
        assert pipe.due(step, ready=lambda s: False, max_late=9) == []  # trains on
    assert [s.handle for s in pipe.due(60, ready=lambda s: False, max_late=9)] == ["h0"]  # 9 past 51: waits
    pipe.start(1, 0, 100, "h1")
    assert [s.handle for s in pipe.due(103, ready=lambda s: True, max_late=9)] == ["h1"]  # there: lands


def test_a_download_with_syncs_in_flight_and_a_second_round_of_a_fragment_in_flight_are_refused():
    pipe = SyncPipeline(SyncSchedule(inner_steps=4, fragments=1, overlap=2))
    pipe.start(0, 0, 4, None)
    with pytest.raises(LocalProtocolError, match="in flight"):
        pipe.rebase(keep_forming=True)
    with pytest.raises(LocalProtocolError, match="under way"):
        pipe.start(0, 1, 8, None)
    pipe.drain()
    assert pipe.rebase(keep_forming=False) == []


def test_finish_lands_what_is_in_flight_and_nothing_starts_after_it():
    pipe = SyncPipeline(SyncSchedule(inner_steps=4, fragments=2, overlap=1))
    pipe.start(0, 0, 2, "a")
    assert [s.handle for s in pipe.finish()] == ["a"]
    assert pipe.starts(4) == [] and not pipe
    with pytest.raises(LocalProtocolError, match="closed"):
        pipe.start(1, 0, 4, "b")


def test_a_group_forms_ahead_and_the_sync_starts_into_it_and_a_pause_starts_it_early_once():
    sched = SyncSchedule(inner_steps=20, fragments=2, overlap=1)  # fragment 0 starts after 10, 30, ...
    pipe = SyncPipeline(sched)
    assert pipe.joins(5, lead=0) == []  # no pace known yet: join at the start step
    assert pipe.joins(5, lead=4) == []  # too early
    assert pipe.joins(6, lead=4) == [(0, 0, 10)]
    pipe.form(0, 0, 6, 10, "g0")
    assert pipe.joins(7, lead=4) == []  # forming already
    assert [(p, r, f.handle) for p, r, f in pipe.starts(10)] == [(0, 0, "g0")]
    pipe.start(0, 0, 10, "s0")
    assert [s.handle for s in pipe.due(11)] == ["s0"]
    # the lead is capped so a fragment joins its next round only after its last one landed
    assert pipe.joins(11, lead=100) == [(1, 0, 20)] and pipe.joins(11, lead=18) == [(1, 0, 20)]
    pipe.form(1, 0, 11, 20, "g1")
    # a pause while fragment 1's group forms: it starts now, and its round is not started again
    (f,) = pipe.take_forming()
    pipe.start(f.fragment, f.round, 12, "early")
    assert [s.handle for s in pipe.drain()] == ["early"]
    assert pipe.starts(20) == []
    assert pipe.joins(21, lead=10) == [(0, 1, 30)]


def test_a_finishing_node_joins_no_round_past_its_last_and_leaves_those_it_had_joined():
    pipe = SyncPipeline(SyncSchedule(inner_steps=20, fragments=2, overlap=1))
    pipe.stop_before(1)
    assert pipe.joins(6, lead=4) == [(0, 0, 10)]
    pipe.form(0, 0, 6, 10, "g0")
    pipe.form(1, 0, 6, 20, "g1")
    assert pipe.stop_before(2) == [] and pipe.last_round == 1  # the earliest stop counts
    assert pipe.stop_before(1) == []  # round 0 is before the last round: kept, started at finish
    assert [f.handle for f in pipe.stop_before(0)] == ["g0", "g1"] and not pipe
    assert pipe.joins(6, lead=4) == []  # stops after round -1: joins nothing
    with pytest.raises(LocalProtocolError):
        pipe.form(0, 0, 6, 10, "g0")
    with pytest.raises(LocalProtocolError):
        pipe.start(0, 0, 10, "s0")


def test_a_node_whose_last_round_lands_late_starts_no_round_past_it():
    """``--rounds 1``, and fragment 1's round 0 (started after step 20) lands only at step 30,
    where fragment 0's round 1 starts (a follower lands when its result is there): that round
    is not started, so the node stops at the rounds the others stop at. (Started, it made one
    peer end a round ahead of its partner, whose final copies then could not be compared.)"""
    sched = SyncSchedule(inner_steps=20, fragments=2, overlap=1)
    pipe, free = SyncPipeline(sched), SyncPipeline(sched)
    pipe.stop_before(1)
    for p in (pipe, free):
        assert p.starts(10) == [(0, 0, None)]
        p.start(0, 0, 10, "f0")
        assert [s.handle for s in p.due(11)] == ["f0"]
        assert p.starts(20) == [(1, 0, None)]
        p.start(1, 0, 20, "f1")
        assert p.due(30, ready=lambda s: True, max_late=None)  # lands at fragment 0's next start
    assert pipe.starts(30) == [] and free.starts(30) == [(0, 1, None)]


def test_a_fast_forward_download_returns_the_forming_groups_and_a_repair_keeps_them():
    pipe = SyncPipeline(SyncSchedule(inner_steps=20, fragments=2, overlap=1))
    pipe.form(0, 0, 6, 10, "g0")
    assert pipe.rebase(keep_forming=True) == [] and 0 in pipe
    assert [f.handle for f in pipe.rebase(keep_forming=False)] == ["g0"] and not pipe
    pipe.form(0, 0, 7, 10, "g0")
    with pytest.raises(LocalProtocolError, match="forming"):
        pipe.drain()


class Pipeline(RuleBasedStateMachine):
    """A node's life, driven at random: what the node loop does with the pipeline at each event."""

    def __init__(self):
        super().__init__()
        self.pipe: SyncPipeline | None = None
        self.step = 0
        self.paused = False
        self.allowed_late = 0  # steps the last step let a due sync whose result was not there stay
        self.started: dict[int, tuple[int, int, int]] = {}  # id -> (fragment, round, landing step)
        self.rounds_started: set[tuple[int, int]] = set()
        self.ended: dict[int, str] = {}  # id -> how it ended: landed, drained, abandoned
        self.next_id = 0
        self.last: int | None = None  # the earliest stop_before: no round from it on starts or forms

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

    def _start(self, p: int, r: int) -> None:
        assert (p, r) not in self.rounds_started, f"fragment {p} round {r} started twice"
        assert self.last is None or r < self.last
        self.rounds_started.add((p, r))
        self.pipe.start(p, r, self.step, self.next_id)
        self.started[self.next_id] = (p, r, self.step + self.schedule.overlap)
        self.next_id += 1

    def _start_forming_now(self) -> None:
        for f in self.pipe.take_forming():
            assert f.starts_after > self.step
            self._start(f.fragment, f.round)

    @rule(lead=st.integers(0, 15), ready=st.sampled_from([None, True, False]),
          max_late=st.sampled_from([None, 0, 3]))
    @precondition(lambda self: self.pipe is not None and not self.paused and not self.pipe.closed)
    def inner_step(self, lead, ready, max_late):
        """One step, landing before starting (as the node does). ``ready``: None lands what is
        due; True/False is what "is its result there" says for every due sync; ``max_late``:
        how far past its landing step such a sync may stay (None: a follower, until its next start)."""
        self.step += 1
        # a due sync whose result is not there may stay that many steps past its landing step
        self.allowed_late = 0 if ready is not False else float("inf") if max_late is None else max_late
        check = None if ready is None else (lambda s: ready)
        for when in ("before", "after"):  # a round lands before its fragment's next one starts,
            due = self.pipe.due(self.step, check, max_late)  # and with tau = 0 right after it started
            for s in due:
                assert s.lands_after <= self.step and self.started[s.handle][2] == s.lands_after
            self._land(due, "landed")
            if when == "before":
                for p, r, forming in self.pipe.starts(self.step):
                    assert p not in self.pipe  # a fragment's round lands before its next one starts
                    assert forming is None or (forming.round, forming.starts_after) == (r, self.step)
                    self._start(p, r)
        for p, r, at in self.pipe.joins(self.step, lead):
            assert self.step < at <= self.step + lead and (p, r) not in self.rounds_started
            assert self.last is None or r < self.last
            self.pipe.form(p, r, self.step, at, ("forming", p, r))

    @rule()
    @precondition(lambda self: self.pipe is not None and not self.paused and not self.pipe.closed)
    def pause(self):
        self._start_forming_now()
        self._land(self.pipe.drain(), "drained")
        self.paused = True

    @rule()
    @precondition(lambda self: self.paused)
    def resume(self):
        self.paused = False

    @rule(to=st.integers(0, 60), fast_forward=st.booleans())
    @precondition(lambda self: self.pipe is not None and not self.pipe.closed)
    def download(self, to, fast_forward):
        """A state download: the node does it only with nothing in flight (groups may be forming)."""
        if self.pipe.in_flight():
            with pytest.raises(LocalProtocolError):
                self.pipe.rebase(keep_forming=not fast_forward)
            return
        forming = self.pipe.forming()
        dropped = self.pipe.rebase(keep_forming=not fast_forward)
        if not fast_forward:
            assert dropped == [] and self.pipe.forming() == forming
            return
        assert dropped == forming and not self.pipe
        self.rounds_started = set()  # the downloaded rounds say where each fragment is
        self.step = max(self.step, to)

    @rule(stop=st.integers(0, 8))
    @precondition(lambda self: self.pipe is not None and not self.pipe.closed)
    def stop_before(self, stop):
        """A finish or ``max_rounds`` becomes known (at any time, also mid-round): groups forming
        for later rounds are left, and no later round forms or starts from then on."""
        before = self.pipe.forming()
        left = self.pipe.stop_before(stop)
        self.last = stop if self.last is None else min(self.last, stop)
        assert all(f.round >= self.last for f in left) and all(f.round < self.last for f in self.pipe.forming())
        assert sorted(left + self.pipe.forming(), key=lambda f: f.fragment) == sorted(before, key=lambda f: f.fragment)

    @rule()
    @precondition(lambda self: self.pipe is not None and not self.pipe.closed)
    def finish(self):
        self._start_forming_now()
        self._land(self.pipe.finish(), "drained")

    @rule()
    @precondition(lambda self: self.pipe is not None and not self.pipe.closed)
    def leave(self):
        self._land([s for s in self.pipe.abandon() if not isinstance(s.handle, tuple)], "abandoned")

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
        # nothing overdue is kept, but by a follower whose result is not there, and never past
        # the step its fragment starts its next round
        assert all(s.lands_after + self.allowed_late > self.step or s.lands_after > self.step
                   for s in self.pipe.in_flight())
        assert all(self.schedule.next_start(s.fragment, s.started_after + 1) > self.step
                   for s in self.pipe.in_flight())
        assert all(f.starts_after > self.step for f in self.pipe.forming())  # nothing forms for a past start
        if self.pipe.closed or self.paused:
            assert not self.pipe


Pipeline.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestPipeline = Pipeline.TestCase
