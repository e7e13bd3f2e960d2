"""A node training in step believes a claim to be far ahead (more rounds than a state's
distance can be judged for) only from peers that averaged with it and could have got there
since (``peer.node.catchup.plausible_progress``, ``CatchUpMixin._plausibly_ahead``). Found by
an adversarial review: two keys that never averaged with anyone, claiming 50 rounds ahead and
serving one state of zeros, made every peer training in step download it."""

import logging
import math
import time
from types import SimpleNamespace

import pytest

from peer.distrust import Distrust
from peer.node.catchup import CatchUpMixin, plausible_progress

ROUND_S = 10.0  # our time per round


@pytest.mark.parametrize("anchor,claimed,elapsed,believed", [
    (None, 100, 1000.0, False),  # never averaged with us: not believed however long ago
    ((0.0, 20), 24, 0.0, True),  # where it averaged with us, two rounds on (2 fragments)
    ((0.0, 20), 26, 0.0, False),  # 3 rounds on at once
    ((0.0, 20), 20 + 2 * 12, 50.0, True),  # 12 rounds on in 5 of ours: within twice our pace, plus 2
    ((0.0, 20), 20 + 2 * 50, 50.0, False),  # 50 rounds on in 5 of ours
    ((0.0, 20), 20 + 2 * 50, 3600.0, True),  # we slept (a stalled process): the swarm went on meanwhile
])
def test_a_claim_is_believed_when_the_time_since_we_last_averaged_allows_it(anchor, claimed, elapsed, believed):
    assert plausible_progress(anchor, claimed, 2, (anchor[0] if anchor else 0.0) + elapsed, ROUND_S) is believed


def test_no_pace_known_believes_nobody_far_ahead():
    assert not plausible_progress((0.0, 20), 30, 2, 100.0, 0.0)


class Node(CatchUpMixin):
    def __init__(self, anchors):
        self.stats = SimpleNamespace(cycle_times=[0.5] * 30)
        self.worker = SimpleNamespace(schedule=SimpleNamespace(inner_steps=20), outer=[None, None])  # a round: 10 s
        self._anchors, self._doubted, self._trusted = anchors, set(), frozenset()
        self._paused_at = -math.inf


def hb(rounds):
    return SimpleNamespace(rounds=rounds)


def test_far_claims_of_strangers_are_dropped_near_ones_kept_and_said_once(caplog, monkeypatch):
    import peer.node.catchup as catchup

    monkeypatch.setattr(catchup.time, "time", lambda: 1000.0)
    a, b, c, d = (bytes([k]) * 32 for k in range(4))
    node = Node({c: (995.0, 10), d: (400.0, 10)})  # c averaged with us 5 s ago, d 600 s ago
    peers = {a: hb((7, 7)), b: hb((55, 55)), c: hb((55, 55)), d: hb((55, 55))}
    ahead = {k: b"digest" for k in peers}
    with caplog.at_level(logging.WARNING, logger="peer.node"):
        kept = node._plausibly_ahead(ahead, peers, 5)
        assert node._plausibly_ahead(ahead, peers, 5) == kept
    assert set(kept) == {a, d}  # a: 2 ahead (the distance check judges it); d: 600 s is 60 of our rounds
    assert caplog.text.count("not believing 2 peer(s)") == 1


def test_a_heartbeat_with_another_count_of_fragments_is_not_believed(monkeypatch):
    """Found by a review: the allowance is per fragment, so a one-entry rounds list holding
    all the fragments' rounds passed at once."""
    import peer.node.catchup as catchup

    monkeypatch.setattr(catchup.time, "time", lambda: 1000.0)
    c = b"\x02" * 32
    node = Node({c: (1000.0, 10)})
    assert node._plausibly_ahead({c: b"d"}, {c: hb((10,))}, 1) == {}


def test_keys_that_averaged_with_us_once_and_waited_are_outvoted_by_the_partners_here(monkeypatch):
    """Found by a review: two keys that averaged with us once, then waited, could claim rounds
    their allowance (which grows with time) let through, serve zeros, and be believed by
    every peer they had met, though all of that peer's partners of the last rounds were at
    its rounds. Such claims must now outnumber those partners."""
    import peer.node.catchup as catchup

    monkeypatch.setattr(catchup.time, "time", lambda: 10_000.0)
    liars, partners = [bytes([k]) * 32 for k in (1, 2)], [bytes([k]) * 32 for k in (3, 4)]
    anchors = {k: (1000.0, 10) for k in liars}  # met us 9000 s (900 of our rounds) ago
    anchors |= {k: (9995.0, 1800) for k in partners}  # averaged with us 5 s ago, at our rounds
    peers = {**{k: hb((1400, 1400)) for k in liars}, **{k: hb((901, 900)) for k in partners}}
    ahead = {k: b"zeros" for k in liars}
    assert Node(anchors)._plausibly_ahead(ahead, peers, 900, 10.0) == {}
    # three keys outnumber the two partners (whatever each vouches for: groups far on land
    # different copies; two vouchers for one state are still needed to download it)
    third = b"\x05" * 32
    node = Node(anchors | {third: (1000.0, 10)})
    assert set(node._plausibly_ahead({**ahead, third: b"other"}, {**peers, third: hb((1400, 1400))}, 900, 10.0)) \
        == {*liars, third}
    # partners met long ago, or now far ahead themselves (we fell behind them), do not count
    stale = anchors | {k: (5000.0, 1800) for k in partners}
    assert set(Node(stale)._plausibly_ahead(ahead, peers, 900, 10.0)) == set(liars)
    moved = {**peers, **{k: hb((1400, 1400)) for k in partners}}
    assert set(Node(anchors)._plausibly_ahead(ahead, moved, 900, 10.0)) == set(liars)


class Agreeing(CatchUpMixin):
    """A node's catch-up check with the swarm's reads and downloads replaced: what it decides
    to download from the heartbeats it reads."""

    def __init__(self, reads, rounds):
        me = b"\xee" * 32
        self.identity = SimpleNamespace(public_key=me)
        self.stats = SimpleNamespace(cycle_times=[0.5] * 30, rounds=list(rounds))
        self.worker = SimpleNamespace(schedule=SimpleNamespace(inner_steps=20), outer=[None, None])
        self._anchors, self._doubted, self._refused_claims, self._digests = {}, set(), set(), {}
        self._trusted, self._peers, self._reads = frozenset(), {}, list(reads)
        self.matchmaker = SimpleNamespace(distrusted=Distrust())
        self._caught_up = self._repair_due = False
        self._repair_tries = self._tie_waits = 0
        self._in_step_at = self._paused_at = -math.inf
        self.downloads: list = []
        self.net = SimpleNamespace(call=lambda read, timeout: read)
        self.presence = SimpleNamespace(peers=lambda run_id, ttl: self._reads.pop(0))
        self.run_id = b"run"

    def _update_peers(self, peers):
        self._peers = dict(peers)

    def _run_size(self):
        return len(self._peers) + 1

    def _served_ahead(self, swarm, keys, at_least):
        return {}  # nobody answers the question at a join

    def _harvest_published(self, wait_s=0.0):
        pass

    def _download(self, swarm, digest, **kw):
        self.downloads.append(digest)
        self._caught_up, self._in_step_at = True, time.time()
        return True


SWARM = SimpleNamespace(heartbeat_ttl_s=10.0, state_chunk_timeout_s=1.0)


def ahead_heartbeats(*keys, rounds=(40, 40), digest=b"theirs"):
    return {k: SimpleNamespace(rounds=rounds, state_digest=digest) for k in keys}


@pytest.mark.parametrize("first_read", ["empty", "split"])
def test_a_node_resumed_from_an_old_checkpoint_believes_the_run_it_fell_behind(first_read):
    """Found by CI under load: a peer killed and restarted from its checkpoint found, at its
    join, a read that showed nobody (or two peers ahead that vouched for different states
    while they landed). It then took itself for in step, judged the run 35 rounds ahead as a
    stranger's far claim, and trained alone for five minutes. Until it has averaged with a
    peer or taken a state, two vouchers bring it to the run, as at any join."""
    a, b = b"\x01" * 32, b"\x02" * 32
    join = {} if first_read == "empty" else {**ahead_heartbeats(a), **ahead_heartbeats(b, digest=b"landing")}
    node = Agreeing([join], rounds=(3, 3))
    node._check_agreement(SWARM, joining=True)
    assert node.downloads == [] and not node._in_step()
    node._peers = ahead_heartbeats(a, b)  # later heartbeats: both at one state, 37 rounds ahead
    node._check_agreement(SWARM)
    assert node.downloads == [[a, b]]


def test_a_node_in_step_still_refuses_strangers_far_ahead():
    a, b, c = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    node = Agreeing([ahead_heartbeats(c, rounds=(3, 3), digest=b"ours")], rounds=(3, 3))
    node._check_agreement(SWARM, joining=True)  # the read shows a peer, none ahead: in step
    assert node._in_step() and node.downloads == []
    node._peers = {**ahead_heartbeats(a, b, digest=b"zeros"), **ahead_heartbeats(c, rounds=(3, 3), digest=b"ours")}
    node._check_agreement(SWARM)
    assert node.downloads == []


def test_the_first_peer_of_a_run_starts_in_step():
    node = Agreeing([{}], rounds=(0, 0))
    node._check_agreement(SWARM, joining=True)
    assert node._in_step() and node._caught_up


def test_a_peer_we_stopped_grouping_with_vouches_for_nothing():
    a, b = b"\x01" * 32, b"\x02" * 32
    node = Agreeing([ahead_heartbeats(a, b, rounds=(4, 4))], rounds=(3, 3))
    node.matchmaker.distrusted.ban(b)
    node._check_agreement(SWARM, joining=True)
    assert node.downloads == []  # a alone: two vouchers are needed among three peers
    node = Agreeing([ahead_heartbeats(a, b, rounds=(4, 4))], rounds=(3, 3))
    node._check_agreement(SWARM, joining=True)
    assert node.downloads == [[a, b]]


def test_back_from_a_pause_a_node_in_step_still_refuses_strangers_far_ahead_and_asks_nobody_else():
    """Found by a review: a resume from a pause read the swarm as a join does, and took any two
    keys' far claim (or what they served) at once. A pause is no join: within IN_STEP_ROUNDS
    of our rounds the anchors still judge, and they let the partners we had through."""
    a, b, partner, other = (bytes([k]) * 32 for k in (1, 2, 3, 4))
    node = Agreeing([{**ahead_heartbeats(a, b, digest=b"zeros")}], rounds=(3, 3))
    node._in_step_at = time.time() - 5
    node._served_ahead = lambda *a: pytest.fail("asked what strangers serve")
    node._check_agreement(SWARM, joining=True)
    assert node.downloads == []
    node = Agreeing([{**ahead_heartbeats(partner, other)}], rounds=(3, 3))
    node._in_step_at = time.time() - 5
    node._anchors = {partner: (time.time() - 600, 6), other: (time.time() - 600, 6)}  # 10 min ago, at our rounds
    node._check_agreement(SWARM, joining=True)
    assert node.downloads == [[partner, other]]


def test_a_node_that_averaged_with_nobody_for_long_judges_claims_as_a_joiner():
    """After IN_STEP_ROUNDS of our rounds (at least IN_STEP_MIN_S) without averaging with a
    peer, the peers may all be new (a long pause, a run that turned over): two vouchers
    bring us to them, as at a join."""
    import peer.node.catchup as catchup

    a, b = b"\x01" * 32, b"\x02" * 32
    node = Agreeing([{}], rounds=(3, 3))
    node._in_step_at = time.time() - catchup.IN_STEP_MIN_S - 1  # round_s here is 10 s: 10 rounds < 120 s
    node._peers = ahead_heartbeats(a, b)
    node._check_agreement(SWARM)
    assert node.downloads == [[a, b]]


def test_the_runs_creator_is_believed_far_ahead_alone():
    creator, partner = b"\x01" * 32, b"\x03" * 32
    node = Agreeing([{}], rounds=(3, 3))
    node._trusted = frozenset({creator})
    node._in_step_at = time.time()
    node._anchors = {partner: (time.time(), 6)}
    node._peers = {**ahead_heartbeats(creator), **ahead_heartbeats(partner, rounds=(3, 3), digest=b"ours")}
    node._check_agreement(SWARM)
    assert node.downloads == [[creator]]


def test_a_suspended_peer_still_vouches_only_a_banned_one_does_not():
    """A suspension is for an audit left unanswered, which proves nothing (a peer under load)."""
    a, b = b"\x01" * 32, b"\x02" * 32
    node = Agreeing([ahead_heartbeats(a, b, rounds=(4, 4))], rounds=(3, 3))
    node.matchmaker.distrusted.suspend(b)
    node._check_agreement(SWARM, joining=True)
    assert node.downloads == [[a, b]]


def test_doubted_claims_at_a_resume_do_not_renew_in_step():
    """Found by a review: a resume whose far claims were all doubted took the branch for
    "nobody ahead" and renewed in step, so a volunteer pausing every few minutes never
    caught up with peers it had no anchors for."""
    a, b = b"\x01" * 32, b"\x02" * 32
    node = Agreeing([ahead_heartbeats(a, b)], rounds=(3, 3))
    node._in_step_at = since = time.time() - 100
    node._check_agreement(SWARM, joining=True)
    assert node.downloads == [] and node._in_step_at == since and not node._caught_up


def test_partners_that_paused_with_us_do_not_outvote_the_ones_that_went_on():
    """Found by a review: three of five peers paused together for a few rounds; at the resume
    their anchors of just before the pause counted as partners here, outvoted the two that
    went on, and the three trained apart from them for good."""
    went_on, paused_with = [bytes([k]) * 32 for k in (1, 2)], [bytes([k]) * 32 for k in (3, 4)]
    now = time.time()
    node = Agreeing([{**ahead_heartbeats(*went_on, rounds=(7, 7)), **ahead_heartbeats(*paused_with, rounds=(3, 3), digest=b"ours")}],
                    rounds=(3, 3))
    node._anchors = {k: (now - 30, 6) for k in went_on + paused_with}
    node._in_step_at, node._paused_at = now - 30, now - 25
    node._check_agreement(SWARM, joining=True)
    assert node.downloads == [went_on]


def test_the_runs_creator_stays_in_step_alone():
    """Every peer believes the creator's state alone: if two strangers could replace the
    creator's model once it had trained alone a while, they would replace everyone's."""
    me = b"\xee" * 32
    node = Agreeing([{}], rounds=(3, 3))
    node._trusted = frozenset({me})
    assert not node._in_step()  # restarted: it catches up as a joiner does (found by CI: it never did)
    node._in_step_at = time.time() - 10_000
    assert node._in_step()


def test_a_restarted_creator_catches_up_with_the_peer_that_went_on():
    """Found by CI: the run's creator, killed and restarted (its bootstrap peer back at the
    same address), took itself to be in step as the creator always was, had no anchors in
    its new process, and refused the one peer that had gone on: they trained apart."""
    me, other = b"\xee" * 32, b"\x01" * 32
    node = Agreeing([ahead_heartbeats(other, rounds=(30, 30))], rounds=(0, 0))
    node._trusted = frozenset({me})
    node._check_agreement(SWARM, joining=True)
    assert node.downloads == [[other]]  # a swarm of two: one voucher


def test_a_repair_does_not_take_a_tie_with_one_peer_while_others_are_not_compared_yet():
    """Found by a review's whole-node runs: after a lone landing, the only heartbeat at our
    rounds was a ghost's (a key that joins groups, sends nothing and averages alone), a tie
    that its smaller key won, and the node set out to download the ghost's model while its
    partners, one landing on, held ours. A tie waits for the peers not compared yet."""
    ghost, a, c = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    node = Agreeing([], rounds=(10, 10))
    node._caught_up, node._repair_due, node._compare_only, node._repair_tries = True, True, False, 0
    node._digests = {(10, 10): b"ours"}
    on_way = {k: SimpleNamespace(rounds=(10, 9), state_digest=b"before") for k in (a, c)}
    node._peers = {ghost: SimpleNamespace(rounds=(10, 10), state_digest=b"ghost's"), **on_way}
    node._check_agreement(SWARM)
    assert node.downloads == [] and node._repair_due  # the tie waits
    assert node._repair_tries == 0  # a wait uses none of the repair's tries (each a try at our rounds)
    node._peers = {ghost: node._peers[ghost], a: SimpleNamespace(rounds=(10, 10), state_digest=b"ours"), c: on_way[c]}
    node._check_agreement(SWARM)
    assert node.downloads == []  # two of three hold ours: kept
    node._peers[c] = SimpleNamespace(rounds=(10, 10), state_digest=b"ours")
    node._check_agreement(SWARM)
    assert node.downloads == [] and not node._repair_due  # every peer compared: done


def test_a_tie_between_two_lone_peers_is_still_broken_once_everyone_was_compared():
    """The tie's rule is unchanged where nobody else can break it: two peers that each averaged
    alone converge on the copy of the smaller key."""
    other = b"\x01" * 32
    node = Agreeing([], rounds=(10, 10))
    node._caught_up, node._repair_due, node._compare_only, node._repair_tries = True, True, False, 0
    node._digests = {(10, 10): b"ours"}
    node._peers = {other: SimpleNamespace(rounds=(10, 10), state_digest=b"theirs")}
    node._check_agreement(SWARM)
    assert node.downloads == [[other]]


def test_a_repair_takes_a_tie_at_once_when_no_peer_is_on_its_way_to_our_rounds():
    """Only a peer a landing or two behind us may come to the rounds we compare at; one far
    behind (a slow follower) or one ahead does not hold the tie back (a review: every key in the
    view did, and the waits used up the repair's tries)."""
    other, far, ahead = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    node = Agreeing([], rounds=(10, 10))
    node._caught_up, node._repair_due, node._compare_only = True, True, True
    node._digests = {(10, 10): b"ours"}
    node._peers = {other: SimpleNamespace(rounds=(10, 10), state_digest=b"theirs"),
                   far: SimpleNamespace(rounds=(6, 6), state_digest=b"old"),
                   ahead: SimpleNamespace(rounds=(11, 10), state_digest=b"on")}
    node._check_agreement(SWARM)
    assert node.downloads == [[other]]
