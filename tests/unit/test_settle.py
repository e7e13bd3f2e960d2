"""Who a node finishing a run waits for before it compares final copies and goes
(``CatchUpMixin._on_way_to``, used by ``_settle_final``)."""

from types import SimpleNamespace

import pytest

from peer.node.catchup import CatchUpMixin

MINE = (5, 5)


def hb(state: str, rounds: tuple[int, ...]) -> SimpleNamespace:
    return SimpleNamespace(state=state, rounds=rounds)


@pytest.mark.parametrize("state,rounds,heard,gone,waits", [
    ("training", (5, 4), True, False, True),  # a landing behind: it comes
    ("averaging", (4, 4), True, False, True),  # two landings behind (its heartbeat lags)
    ("training", (3, 3), True, False, True),  # two rounds behind: still counted
    ("training", (2, 3), True, False, False),  # further behind: a slow follower of a live run, not this end
    ("training", (5, 5), True, False, True),  # at our rounds but still training: it may finish here next
    ("finishing", (5, 5), True, False, False),  # finished at our rounds: compared, not waited for
    ("finishing", (4, 4), True, True, False),  # finished a round before us and gone (its beats stopped)
    ("training", (6, 5), True, False, False),  # ahead of us: a live run goes on
    ("paused", (5, 4), True, False, False),
    ("leaving", (5, 4), True, False, False),
    ("training", (2, 2), False, False, True),  # not heard since we began: its heartbeat may be old
    ("training", (2, 2), False, True, False),  # ... until it stood still for two intervals
])
def test_who_a_finishing_node_waits_for(state, rounds, heard, gone, waits):
    assert CatchUpMixin._on_way_to(MINE, hb(state, rounds), heard=heard, gone=gone) is waits
