"""The swarm's pace from heartbeats, and who is slow (peer.pace): sans-IO."""

from __future__ import annotations

import pytest

from peer.pace import FAST_ABOVE, SLOW_BELOW, SLOW_FOR, SwarmClock, straggle_steps


def beat(clock: SwarmClock, key: bytes, t: float, steps: int, state: str = "training") -> None:
    """A heartbeat of a peer that has trained ``steps`` inner steps (100 tokens each)."""
    clock.observe(key, t, steps * 100, state)


def test_pace_is_steps_per_second_between_two_heartbeats_and_the_median_over_peers():
    c = SwarmClock(heartbeat_interval_s=3.0, tokens_per_step=100)
    assert c.swarm_pace() is None
    for key, rate in ((b"a", 10.0), (b"b", 12.0), (b"c", 2.0)):
        beat(c, key, 100.0, 0)
        beat(c, key, 103.0, int(3 * rate))
    assert c.swarm_pace() == pytest.approx(10.0)


def test_a_repeated_or_older_heartbeat_changes_nothing_and_a_close_one_keeps_the_last_pace():
    c = SwarmClock(heartbeat_interval_s=4.0, tokens_per_step=100)
    beat(c, b"a", 10.0, 0)
    beat(c, b"a", 14.0, 40)
    assert c.swarm_pace() == pytest.approx(10.0)
    beat(c, b"a", 14.0, 40)  # the same heartbeat read again
    beat(c, b"a", 12.0, 99)  # an older one
    assert c.swarm_pace() == pytest.approx(10.0)
    beat(c, b"a", 15.0, 41)  # 1 s after the last: too close to measure, the last pace stands
    assert c.swarm_pace() == pytest.approx(10.0)
    beat(c, b"a", 20.0, 40)  # tokens going back (another run's ledger?) measure nothing
    assert c.swarm_pace() is None


def test_peers_not_training_do_not_count_and_forgotten_peers_are_gone():
    c = SwarmClock(heartbeat_interval_s=2.0, tokens_per_step=100)
    for key in (b"a", b"b"):
        beat(c, key, 0.0, 0)
        beat(c, key, 2.0, 20 if key == b"a" else 80)
    assert c.swarm_pace() == pytest.approx(25.0)
    beat(c, b"b", 4.0, 80, state="paused")
    assert c.swarm_pace() == pytest.approx(10.0)
    c.forget([b"a"])
    assert c.swarm_pace() is None


def test_slow_with_hysteresis():
    c = SwarmClock(heartbeat_interval_s=1.0, tokens_per_step=100)
    for key in (b"a", b"b", b"c"):
        beat(c, key, 0.0, 0)
        beat(c, key, 1.0, 10)
    assert not c.is_slow(None, now=0.0)  # our own pace not known yet
    assert not c.is_slow(10.0, now=0.0)  # as fast as the others
    slow = SLOW_BELOW * 10.0 - 0.1
    assert not c.is_slow(slow, now=1.0)  # below the bound, but not for long yet
    assert not c.is_slow(slow, now=1.0 + SLOW_FOR - 0.1)
    assert c.is_slow(slow, now=1.0 + SLOW_FOR)  # below it for SLOW_FOR heartbeat intervals
    assert c.is_slow((SLOW_BELOW + FAST_ABOVE) / 2 * 10.0, now=4.0)  # between the bounds: still slow
    assert not c.is_slow(FAST_ABOVE * 10.0 + 0.1, now=5.0)
    assert not c.is_slow((SLOW_BELOW + FAST_ABOVE) / 2 * 10.0, now=6.0)  # between the bounds: still not slow
    c.forget([b"a", b"b", b"c"])
    assert not c.is_slow(1.0, now=7.0)  # nobody to compare with


def test_a_dip_below_the_bound_shorter_than_slow_for_is_not_slow():
    """Equal peers on shared cores dip below each other's pace for a moment (a neighbour
    starting up, an all-reduce): only a pace that stays low makes a node follow."""
    c = SwarmClock(heartbeat_interval_s=2.0, tokens_per_step=100)
    for key in (b"a", b"b", b"c"):
        beat(c, key, 0.0, 0)
        beat(c, key, 2.0, 20)
    t = 0.0
    for _ in range(10):  # below the bound for a little less than SLOW_FOR intervals, then back
        assert not c.is_slow(SLOW_BELOW * 10.0 - 1.0, now=t)
        assert not c.is_slow(SLOW_BELOW * 10.0 - 1.0, now=t + SLOW_FOR * 2.0 - 0.5)
        assert not c.is_slow(10.0, now=t + SLOW_FOR * 2.0)
        t += 10.0


def test_one_liar_does_not_move_the_median_of_three():
    c = SwarmClock(heartbeat_interval_s=1.0, tokens_per_step=100)
    for key, step in ((b"a", 10), (b"b", 11), (b"liar", 10**9)):
        beat(c, key, 0.0, 0)
        beat(c, key, 1.0, step)
    assert c.swarm_pace() == pytest.approx(11.0)
    assert not c.is_slow(10.0, now=0.0) and not c.is_slow(10.0, now=100.0)


def test_until_a_second_heartbeat_the_pace_is_the_reported_tokens_per_second_in_steps():
    c = SwarmClock(heartbeat_interval_s=3.0, tokens_per_step=100)
    c.observe(b"a", 10.0, 0, "training", tokens_per_s=0.0)  # just started: says nothing
    assert c.swarm_pace() is None
    c.forget([b"a"])
    c.observe(b"a", 10.0, 3000, "training", tokens_per_s=800.0)
    assert c.swarm_pace() == pytest.approx(8.0)
    c.observe(b"a", 13.0, 6000, "training", tokens_per_s=800.0)  # then the steps trained between heartbeats
    assert c.swarm_pace() == pytest.approx(10.0)


def test_the_pace_is_what_a_peer_trained_not_how_far_its_step_counter_moved():
    """A follower moves its step counter faster than it trains; its heartbeat's tokens say what
    it trained. Counting its counter would make the others look slow and follow in turn."""
    c = SwarmClock(heartbeat_interval_s=1.0, tokens_per_step=100)
    for key, steps in ((b"a", 10), (b"b", 10), (b"follower", 5)):
        beat(c, key, 0.0, 0)
        beat(c, key, 1.0, steps)
    assert c.swarm_pace() == pytest.approx(10.0)
    assert not c.is_slow(10.0)


def test_a_node_its_group_waited_for_is_slow_and_held_so_while_the_others_speed_up():
    """A group that formed with a slow member waits for its push every round, so the others'
    pace (waits included) drops to its own and the pace test never finds it slow: being
    waited for does, at the first such sync (each one holds every fast member of the group),
    and the hold outlasts the others' pace measuring the wait still."""
    c = SwarmClock(heartbeat_interval_s=2.0, tokens_per_step=100)
    for key in (b"a", b"b"):
        beat(c, key, 0.0, 0)
        beat(c, key, 2.0, 10)  # throttled by us: 5 steps/s, as we are
    assert not c.is_slow(5.0, now=10.0)
    assert not c.kept_waiting(1.5, round_s=8.0, now=14.0)  # under a fifth of a round
    assert c.kept_waiting(2.5, round_s=8.0, now=16.0)  # over a fifth of a round
    assert c.is_slow(5.0, now=16.0 + 3 * 2.0 - 0.1)  # held, though our pace equals theirs
    for key in (b"a", b"b"):
        beat(c, key, 4.0, 40)  # no longer waiting for us: 15 steps/s
    assert c.is_slow(5.0, now=30.0)  # the hold is over; now the pace test says so


def test_kept_waiting_needs_half_a_second_and_a_fifth_of_a_round():
    c = SwarmClock(heartbeat_interval_s=2.0, tokens_per_step=100)
    for _ in range(5):  # equal peers on shared cores, each landing up to a tenth of a round late
        assert not c.kept_waiting(0.45, round_s=2.0, now=0.0)
        assert not c.kept_waiting(1.55, round_s=8.0, now=0.0)
        # a run that lets results land up to 0.3 of a round late: equal peers drift that far
        assert not c.kept_waiting(4.5, round_s=8.0, now=0.0, late_share=0.3)


def test_a_node_far_short_of_a_round_the_others_started_is_the_straggler_at_once():
    """Half its group started a round while it was more than twice the run's late share of
    a round short of it (or a fifth of a round, if more): it follows now, held so, rather
    than after the others waited for it. Equal peers drift apart by up to the late share."""
    assert straggle_steps(40, 0.1) == 8 and straggle_steps(100, 0.1) == 20
    assert straggle_steps(100, 0.25) == 50 and straggle_steps(3, 0.0) == 1
    c = SwarmClock(heartbeat_interval_s=2.0, tokens_per_step=100)
    assert not c.is_slow(None, now=1.0)  # no pace known yet: the first sync of a run
    assert c.straggling(now=1.0)
    assert not c.straggling(now=2.0)  # already: told once
    assert c.is_slow(None, now=1.0 + 3 * 2.0 - 0.1)  # held for three heartbeat intervals
    assert not c.is_slow(None, now=1.0 + 3 * 2.0 + 0.1)  # then the pace test decides
