"""A node training in step believes a claim to be far ahead (more rounds than a state's
distance can be judged for) only from peers that averaged with it and could have got there
since (``peer.node.catchup.plausible_progress``, ``CatchUpMixin._plausibly_ahead``). Found by
an adversarial review: two keys that never averaged with anyone, claiming 50 rounds ahead and
serving one state of zeros, made every peer training in step download it."""

import logging
from types import SimpleNamespace

import pytest

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
        self._anchors, self._doubted = anchors, set()


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
