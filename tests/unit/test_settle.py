"""Who a node finishing a run waits for before it compares final copies and goes
(``CatchUpMixin._on_way_to``, used by ``_settle_final``)."""

from types import SimpleNamespace

import pytest

from peer.node.catchup import CatchUpMixin

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
    assert CatchUpMixin._on_way_to(MINE, hb(state, rounds), heard=heard) is waits
