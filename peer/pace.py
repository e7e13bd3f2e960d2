"""The swarm's pace, from peers' heartbeats: whether this node is slower than the others, and
so follows their rounds (sans-IO).

Rounds are counted on a node's step counter (round r of fragment p starts after step
``offset_p + r*H``), and peers meet by (fragment, round). A peer whose inner steps take twice
as long reaches each round twice as late; it would find every group gone, average alone and
be repaired from the others, contributing nothing. Instead, a node slower than the swarm
follows the others' rounds:

- it joins the group of a fragment's next round when another peer has joined it (it polls
  the round's joins once its previous round of that fragment has landed; the others join
  as soon as theirs has), or by its own schedule if nobody does;
- when half the group's other members have sent it their frames (they started the round's
  all-reduce), it moves its step counter on to the sync's start step and hands over its own
  pseudo-gradient at once, with the steps it managed.

Its pseudo-gradient covers fewer inner steps, and its weight (the tokens it trained since its
last sync, which the group weights the average by) is smaller in the same proportion. A peer
at half the speed contributes about half the tokens of each round, in the same groups as
everyone else, and the others do not wait for it: a group forms when the fast peers'
schedule says, and the slow one is in it.

Who is slower: a node compares its own pace (inner steps per second of compute and rest, its
waits on the network left out) with the swarm's (the median, over peers that are training, of
the inner steps each one trained per second between its last two heartbeats, waits included).
Below ``SLOW_BELOW`` of it for ``SLOW_FOR`` heartbeat intervals in a row the node is slow, until
it is back above ``FAST_ABOVE`` (so it does not flap). A peer as fast as the others is never slow
by this test, since its waits lower the swarm's pace and not its own, so it never moves its
counter: only the slow one adapts (among equals, the one behind its group's start skips the
few steps to it when the others start: ``peer.node.syncs._keep_pace``). Equals on
shared cores are not equal from one second to the next (a peer that is still starting, a
neighbour's all-reduce): with a bound of 0.75 and no time in it, two of four equal peers on a
2-core machine took themselves for slow at their 21st step, moved their counters most of a
round on and averaged alone out of step. A peer half as fast as the others (the case this is
for) is below 0.6 all the time.

Being waited for is the other sign (``SwarmClock.kept_waiting``): a group that formed with a
slow member waits for its part every round (the push deadline is long), so the others' pace,
waits included, drops to the slow one's and the test above never finds it slow: the whole
swarm would run at its pace. A node whose group's other members (half of them, so one liar of
three cannot decide it) had sent their frames a fifth of a round before it started is slow
(frames marked ``PushSlice.stopping`` do not count: a member that pauses, stops or catches up by
a download starts its rounds before its step, which says nothing about our pace; nor do a
banned member's),
and held so for ``HOLD_FOR`` intervals while the others, no longer waiting, show their own pace
again. One such sync is enough: each one the slow peer waits out holds every fast member of
its group for that long, and the first sync of a run comes before 20 steps are timed, so the
pace test cannot have spoken yet. (With two syncs in a row, a peer at half speed held its
groups about 2 s at each of its first two syncs, 4.4 s of the fast peers' 5.7-7.9 s of
waiting in a 10-round ``bench/swarm.py --slow 2`` run at H = 40; with one, only at its
first.) An equal peer that was late once (a checkpoint, a neighbour's burst on shared cores)
follows for ``HOLD_FOR`` intervals, training a few steps fewer, and is fast again after.
Nor need it wait to be waited for at a run's first sync, before its pace is known: a node
still more than ``straggle_steps`` short of a round's start when half its group's other
members have started it is the straggler at once (``SwarmClock.straggling``), and follows
before they wait for it. (Only while its pace is unknown: after that the pace test, over many
steps, decides, which one moment's lag on shared cores cannot fool.)

One peer lying about its pace does not move a median; a liar in a swarm of two (or a colluding
majority) can make a node a follower, which then trains fewer steps per round but still
averages them with their true weight; it moves its counter only to the start of a round whose
group has formed with it, less than a round ahead. A node only ever moves on,
never back: a node ahead of the others waits for them at matchmaking
(``peer.matchmaking.Matchmaker.align_delay``).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

SLOW_BELOW = 0.6  # of the swarm's pace: below it for SLOW_FOR intervals a node is slow ...
FAST_ABOVE = 0.8  # ... until it is back above this
SLOW_FOR = 2.0  # heartbeat intervals below SLOW_BELOW before a node is slow
STRAGGLE_SHARE = 0.2
"""... by at least this share of a round (and half a second), or twice the run's
``sync.late_share`` if that is more: peers of equal speed drift apart by up to that share,
since each trains on so far past a landing step whose result is late
(``peer.sync_pipeline.late_allowance``) before it waits for the others again."""
STRAGGLED = 1  # syncs in a row at which our group waited for us before a node is slow ...
HOLD_FOR = 3.0  # ... for at least this many heartbeat intervals
TRAINING = frozenset({"training", "averaging", "finishing"})


def straggle_steps(inner_steps: int, late_share: float = 0.1) -> int:
    """How many inner steps short of a round's start step we may be when half our group's
    other members start it, before we are the straggler (``SwarmClock.straggling``): the
    share of a round that ``kept_waiting`` allows, in steps. Equal peers drift apart by up to
    the run's ``late_share`` of a round (each trains on that far past a late landing), so
    twice that, and at least ``STRAGGLE_SHARE``."""
    return max(1, math.ceil(max(STRAGGLE_SHARE, 2 * late_share) * inner_steps))


@dataclass(frozen=True, slots=True)
class _Seen:
    sent_at: float
    tokens: int
    pace: float | None  # inner steps trained per second between its last two heartbeats, if known


class SwarmClock:
    """Peers' heartbeats over time: the swarm's pace, and whether we are slower."""

    def __init__(self, heartbeat_interval_s: float, tokens_per_step: int):
        self.interval_s = heartbeat_interval_s
        self.tokens_per_step = tokens_per_step
        self._seen: dict[bytes, _Seen] = {}
        self._slow = False
        self._below_since: float | None = None  # since when our pace has been below SLOW_BELOW
        self._held_until = 0.0  # slow at least until then (we kept our groups waiting: straggled)
        self._straggled = 0  # syncs in a row at which we kept our group waiting

    def observe(self, key: bytes, sent_at: float, tokens: int, state: str, tokens_per_s: float = 0.0) -> None:
        """One heartbeat read from the DHT (a read may return the same heartbeat again). A
        peer's pace is the inner steps it *trained* per second between its last two heartbeats
        (its tokens over the run's tokens per step), not how far its step counter moved: a
        follower moves its counter faster than it trains, and counting that would make the
        others look slow to themselves and follow in turn. Until its second heartbeat, the
        tokens per second it reports (since it started training, waits included)."""
        if state not in TRAINING:
            self._seen.pop(key, None)  # paused, joining, leaving: its pace is not the swarm's
            return
        old = self._seen.get(key)
        if old is not None and sent_at <= old.sent_at:
            return  # the same heartbeat again, or an older one
        pace = tokens_per_s / self.tokens_per_step if old is None and tokens_per_s > 0 else None
        if old is not None and sent_at - old.sent_at >= 0.5 * self.interval_s and tokens >= old.tokens:
            pace = (tokens - old.tokens) / self.tokens_per_step / (sent_at - old.sent_at)
        elif old is not None and tokens >= old.tokens:
            pace = old.pace  # too close to the last one to measure: keep the last measure
        self._seen[key] = _Seen(sent_at, tokens, pace)

    def forget(self, keys) -> None:
        for k in keys:
            self._seen.pop(k, None)

    def swarm_pace(self) -> float | None:
        """The median pace of the peers that have one (steps per second)."""
        paces = [s.pace for s in self._seen.values() if s.pace is not None]
        return statistics.median(paces) if paces else None

    def is_slow(self, own_pace: float | None, now: float | None = None) -> bool:
        """Whether a node training at ``own_pace`` steps per second (its waits left out) is
        slower than the swarm: below ``SLOW_BELOW`` of it since ``SLOW_FOR`` heartbeat
        intervals (``now``: monotonic seconds), and then until it is above ``FAST_ABOVE``."""
        now = time.monotonic() if now is None else now
        if now < self._held_until:
            return True
        swarm = self.swarm_pace()
        if not own_pace or not swarm:
            self._slow, self._below_since = False, None
        elif own_pace < SLOW_BELOW * swarm:
            if self._below_since is None:
                self._below_since = now
            if now - self._below_since >= SLOW_FOR * self.interval_s:
                self._slow = True
        else:
            self._below_since = None
            if own_pace > FAST_ABOVE * swarm:
                self._slow = False
        return self._slow

    def straggling(self, now: float | None = None) -> bool:
        """Half our group's other members started a round while we were still more than
        ``straggle_steps`` short of its start step: we are the straggler now, before they wait
        for us (``kept_waiting`` says so only after they did). Slow, and held so for
        ``HOLD_FOR`` heartbeat intervals. -> whether this made us slow (False: we were already)."""
        now = time.monotonic() if now is None else now
        if now < self._held_until:
            return False
        self._slow, self._held_until, self._below_since = True, now + HOLD_FOR * self.interval_s, None
        return True

    def kept_waiting(self, waited_s: float, round_s: float, now: float | None = None,
                     late_share: float = 0.1) -> bool:
        """After a sync: the others' frames had waited ``waited_s`` for ours (``round_s``: how
        long a round of our steps takes). Kept waiting a fifth of a round (at least half a
        second) at ``STRAGGLED`` syncs in a row, we are the straggler: slow, and held so for
        ``HOLD_FOR`` heartbeat intervals. -> whether this made us slow.

        Why a second signal: a group that formed with a slow member waits for its push every
        round, so the others' pace (waits included) drops to the slow one's, and by the pace
        test it is as fast as the swarm; the whole swarm then runs at its pace for ever. Its
        being waited for says so at once; the hold lets the others' pace be measured again
        once they no longer wait."""
        now = time.monotonic() if now is None else now
        self._straggled = self._straggled + 1 if waited_s >= max(0.5, max(STRAGGLE_SHARE, 2 * late_share) * round_s) else 0
        if self._straggled < STRAGGLED or now < self._held_until:
            return False
        self._slow, self._held_until, self._below_since = True, now + HOLD_FOR * self.interval_s, None
        return True
