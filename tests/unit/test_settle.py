"""Who a node finishing a run waits for before it compares final copies and goes
(``SettleMixin._on_way_to``, used by ``_settle_final``)."""

import threading
import time
from types import SimpleNamespace
from unittest.mock import patch

import pytest

from peer.distrust import Distrust

from peer.node.catchup import download_s
from peer.allreduce import ROUND_SPAN
from peer.node.settle import SettleMixin, final_vote, settle_limits

MINE = (5, 5)


def hb(state: str, rounds: tuple[int, ...]) -> SimpleNamespace:
    return SimpleNamespace(state=state, rounds=rounds)


@pytest.mark.parametrize("state,rounds,heard,waits", [
    ("training", (5, 4), True, True),  # a landing behind: it comes
    ("averaging", (4, 4), True, True),  # two landings behind (its heartbeat lags)
    ("finishing", (4, 4), True, True),  # told to finish, training to the end of its round
    ("training", (3, 3), True, True),  # two rounds behind: still counted
    ("training", (2, 3), True, False),  # further behind: a slow follower of a live run, not this end
    ("training", (5, 5), True, True),  # at our rounds but still training: it may finish here next
    ("finished", (5, 5), True, False),  # finished at our rounds: compared, not waited for
    ("finished", (4, 4), True, False),  # finished a round before us: it will not come
    ("training", (6, 5), True, False),  # ahead of us: a live run goes on
    ("paused", (5, 4), True, False),
    ("leaving", (5, 4), True, False),
    ("training", (2, 2), False, True),  # not heard since we began: its heartbeat may be old (a dead one's expires)
    ("finishing", (1, 1), False, True),  # ... also one whose last round is landing, which beats nothing meanwhile
])
def test_who_a_finishing_node_waits_for(state, rounds, heard, waits):
    assert SettleMixin._on_way_to(MINE, hb(state, rounds), heard=heard) is waits


A, B, C, D, E, L = (bytes([k]) * 32 for k in (2, 3, 4, 5, 6, 1))  # L: the smallest key


def test_a_finisher_takes_a_tie_then_a_majority_that_came_later():
    """Found by a review: A and B each averaged their last round alone (copies X and Y), C, D
    and E together (Z), and A and B finished first. B takes A's copy (a tie goes to the
    smallest key's); then the three arrive, and B takes Z too (it used to stop at one
    download, and stayed on X while everyone else ended on Z)."""
    best, holders, take = final_vote({A: b"X"}, B, b"Y")
    assert (best, holders, take) == (b"X", [A], True)
    taken = len(holders)
    best, holders, take = final_vote({A: b"X", C: b"Z", D: b"Z", E: b"Z"}, B, b"X", taken)
    assert (best, take) == (b"Z", True) and len(holders) == 3
    taken = len(holders)
    assert final_vote({A: b"Z", C: b"Z", D: b"Z", E: b"Z"}, B, b"Z", taken)[2] is False  # agreed


def test_a_liar_can_move_a_finisher_at_most_once_per_holder_it_adds():
    """L (the smallest key) claims whichever copy suits it. Beside one honest holder of a copy
    it breaks a tie once; after that it needs a copy with more holders than the one we took,
    and switching sides gives it none."""
    ours = b"X"
    best, holders, take = final_vote({A: b"X", C: b"Z", L: b"W"}, B, ours)
    assert best == b"X" and not take  # a copy of its own has one holder: the majority keeps ours
    best, holders, take = final_vote({A: b"X", C: b"Z", L: b"Z"}, B, ours)
    assert (best, take) == (b"Z", True)  # a 2-2 tie broken by its key: C's copy (only that digest is fetched)
    taken, ours = len(holders), b"Z"
    for claim in (b"X", b"W", b"V"):  # now it switches sides: nothing moves us again
        assert final_vote({A: b"X", C: b"Z", L: claim}, B, ours, taken)[2] is False


def test_the_settle_deadline_leaves_a_partner_its_longest_last_round():
    swarm = SimpleNamespace(allreduce_timeout_s=20.0, heartbeat_interval_s=3.0, state_chunk_timeout_s=5.0)
    deadline, limit = settle_limits(swarm, 100.0)
    assert deadline == 100.0 + ROUND_SPAN * 20.0 + 2 * 3.0  # the longest an all-reduce may take, and two heartbeats
    assert limit == deadline + download_s(swarm)  # one download, ours or from us, at most


class Finisher(SettleMixin):
    """Just what ``_settle_copy`` uses of a node: the heartbeats it reads are ``views`` (one per
    read, the last repeated), and a download succeeds when ``serves`` has the wanted copy."""

    def __init__(self, me: bytes, ours: bytes, views: list[dict], serves: set[bytes]):
        self.identity = SimpleNamespace(public_key=me)
        self.state, self.state_digest, self.state_rounds = "training", ours, MINE
        self.stats = SimpleNamespace(rounds=list(MINE))
        self._peers, self.views, self.serves, self.asked = {}, views, serves, []
        self.stop_event = threading.Event()
        self.state_server = SimpleNamespace(serving=False)
        self._partners: dict[bytes, float] = {}
        self._trusted: frozenset[bytes] = frozenset()  # the run's creator is none of these peers
        self.matchmaker = SimpleNamespace(distrusted=Distrust())
        self.presence = SimpleNamespace(peers=lambda run_id, ttl: None)
        self.net = SimpleNamespace(call=self._read)
        self.run_id = b"r"
        self.reads = 0

    def _read(self, coro, timeout):
        """The next view, with our own latest heartbeat in it as a real read has; None stands
        for a DHT lookup that came back empty (not even us)."""
        self.reads += 1
        view = self.views.pop(0) if len(self.views) > 1 else self.views[0]
        return {} if view is None else {**view, self.identity.public_key: finished(self.state_digest, 0)}

    def _harvest_published(self, wait_s=0.0):
        pass

    def _beat(self, swarm):
        pass

    def _download(self, swarm, holders, *, want, **kw):
        self.asked.append(want)
        if want in self.serves:
            self.state_digest = want
            return True
        return False


def finished(digest: bytes, n: int) -> SimpleNamespace:
    return SimpleNamespace(state="finished", rounds=MINE, state_digest=digest, sent_at=n)


def test_a_liar_whose_made_up_copy_wins_a_tie_is_left_out_and_the_honest_finishers_still_meet():
    """Found by a review: H1 and H2 averaged their last round alone (X and Y); L, with the
    smallest key, says it finished holding Z and serves nothing. Z wins the three-way tie; once
    both tries at it failed, L is out of the vote, and H2 takes H1's copy (the tie without L)."""
    swarm = SimpleNamespace(allreduce_timeout_s=20.0, heartbeat_interval_s=3.0, heartbeat_ttl_s=10.0,
                            state_chunk_timeout_s=5.0)
    node = Finisher(B, b"Y", [{A: finished(b"X", 1), L: finished(b"Z", 1)}], serves={b"X"})
    with patch("peer.node.settle.SETTLE_POLL_S", 0.0):
        node._settle_copy(swarm)
    assert node.asked == [b"Z", b"Z", b"X"] and node.state_digest == b"X"


SWARM = SimpleNamespace(allreduce_timeout_s=20.0, heartbeat_interval_s=3.0, heartbeat_ttl_s=10.0,
                        state_chunk_timeout_s=5.0)


def test_a_read_that_does_not_show_our_own_heartbeat_concludes_nothing():
    """Found in CI under load: a DHT lookup came back empty rather than failing, and a finisher
    that had no other peer in its view left at once, while its partner, still in its last
    round, ended on another copy. A read without our own final heartbeat is no view."""
    node = Finisher(B, b"Y", [None, None, {A: finished(b"Y", 1)}], serves=set())
    with patch("peer.node.settle.SETTLE_POLL_S", 0.0):
        node._settle_copy(SWARM)
    assert node.reads == 3 and node.asked == []  # agreed with A, once a read showed us


@pytest.mark.parametrize("ago_s,reads", [(0.0, 3), (30.0, 1)])
def test_a_peer_that_averaged_with_us_lately_is_waited_for_until_a_read_shows_it(ago_s, reads):
    """A partner of our last rounds that no read has shown yet may be in its last round still:
    it counts as on its way (two reads without it here) until a read shows it finished. One
    that averaged with us longer ago than a heartbeat lives is not waited for."""
    node = Finisher(B, b"Y", [{}, {}, {A: finished(b"Y", 1)}], serves=set())
    node._partners = {A: time.monotonic() - ago_s}
    with patch("peer.node.settle.SETTLE_POLL_S", 0.0):
        node._settle_copy(SWARM)
    assert node.reads == reads and node.asked == []


def test_a_banned_peer_neither_votes_on_the_final_copy_nor_holds_us_back():
    """Found by a review: a liar we banned still counted in the final vote (its smallest key
    broke a tie toward its copy), and its heartbeats saying it was on its way held a
    finisher to the deadline. A peer we stopped grouping with is out of the view."""
    node = Finisher(B, b"Y", [{A: finished(b"X", 1), L: finished(b"Z", 1)}], serves={b"X", b"Z"})
    node.matchmaker.distrusted.ban(L)
    with patch("peer.node.settle.SETTLE_POLL_S", 0.0):
        node._settle_copy(SWARM)
    assert node.asked == [b"X"] and node.state_digest == b"X"  # the tie with A alone: A's key is smaller


def test_a_suspended_peer_still_votes_on_the_final_copy():
    """Found by a review: leaving out a holder we had suspended (an unanswered audit, which
    proves nothing) turned a 2-1 vote into a tie that our smaller key kept, and the run ended
    on two copies."""
    node = Finisher(A, b"X", [{B: finished(b"Y", 1), C: finished(b"Y", 1)}], serves={b"Y"})
    node.matchmaker.distrusted.suspend(B)
    with patch("peer.node.settle.SETTLE_POLL_S", 0.0):
        node._settle_copy(SWARM)
    assert node.asked == [b"Y"] and node.state_digest == b"Y"


def test_a_finisher_does_not_take_a_tie_while_its_partners_are_on_their_way():
    """Found by a review's whole-node runs (2 of 19 with a ghost): the first honest finisher saw
    only a ghost finished at its rounds (its own model, trained alone), lost the tie to the
    ghost's smaller key and took that model; each honest partner finishing after it then saw
    two holders of it and took it too. A take waits while peers are on their way to our rounds:
    here the partners come holding our copy, and nothing is downloaded."""
    node = Finisher(B, b"Y", [{L: finished(b"G", 1)}, {L: finished(b"G", 1)},
                              {L: finished(b"G", 1), A: finished(b"Y", 1), C: finished(b"Y", 1)}], serves={b"G"})
    node._partners = {A: time.monotonic(), C: time.monotonic()}
    swarm = SimpleNamespace(allreduce_timeout_s=0.2, heartbeat_interval_s=0.2, heartbeat_ttl_s=10.0,
                            state_chunk_timeout_s=5.0)
    with patch("peer.node.settle.SETTLE_POLL_S", 0.01):
        node._settle_copy(swarm)  # to the deadline: the ghost holds another copy to the end
    assert node.asked == [] and node.state_digest == b"Y"


@pytest.mark.parametrize("partner", [True, False])
def test_only_a_partner_on_its_way_holds_a_tie_back_and_only_until_the_last_heartbeat(partner):
    """A partner of our last rounds on its way that never finishes (or a liar in our last group
    saying it trains at our rounds) holds a tie back only until the last heartbeat before the
    deadline: the tie is still broken then, so two honest copies do not stay apart. A stranger
    on its way holds nothing back: it could say it is coming to one finisher until its decision
    and then finish with the other copy for the next, and two honest finishers would end apart
    (a review of the first version, which held any take back)."""
    swarm = SimpleNamespace(allreduce_timeout_s=0.2, heartbeat_interval_s=0.2, heartbeat_ttl_s=10.0,
                            state_chunk_timeout_s=5.0)
    coming = SimpleNamespace(state="training", rounds=MINE, state_digest=b"", sent_at=1)
    node = Finisher(B, b"Y", [{A: finished(b"X", 1), C: coming}], serves={b"X"})
    if partner:
        node._partners = {C: time.monotonic()}
    began = time.monotonic()
    with patch("peer.node.settle.SETTLE_POLL_S", 0.01), \
            patch.object(Finisher, "_download", lambda self, swarm, holders, *, want, **kw: (
                self.asked.append((want, time.monotonic() - began, self.reads)), setattr(self, "state_digest", want)
            )[-1] or True):
        node._settle_copy(swarm)
    deadline = ROUND_SPAN * 0.2 + 2 * 0.2
    assert [w for w, _, _ in node.asked] == [b"X"] and node.state_digest == b"X"
    _, at, reads = node.asked[0]
    if partner:
        assert at >= deadline - 0.2  # held back to the last heartbeat before the deadline
    else:
        assert reads == 1  # at the first read that showed the tie
