"""Pure parts of matchmaking: batches, group assignment, seeds and group IDs."""

import pytest

from peer.matchmaking import assign_groups, batch_of, group_id_of, round_seed

KEYS = [bytes([i]) * 32 for i in range(11)]


@pytest.mark.parametrize("n", range(1, 12))
@pytest.mark.parametrize("group_size", [2, 3, 8])
def test_groups_partition_the_batch_with_bounded_near_equal_sizes(n, group_size):
    groups = assign_groups(round_seed(b"r" * 20, 0, 5), KEYS[:n], group_size)
    flat = [k for g in groups for k in g]
    assert sorted(flat) == sorted(KEYS[:n])  # everyone exactly once
    sizes = [len(g) for g in groups]
    assert max(sizes) <= group_size and max(sizes) - min(sizes) <= 1
    assert len(groups) == -(-n // group_size)


def test_groups_do_not_depend_on_the_order_of_the_view_but_change_with_the_round():
    seed = round_seed(b"r" * 20, 2, 7)
    assert assign_groups(seed, KEYS, 3) == assign_groups(seed, list(reversed(KEYS)), 3)
    other_rounds = {tuple(assign_groups(round_seed(b"r" * 20, 2, r), KEYS, 3)) for r in range(8)}
    assert len(other_rounds) > 1  # reshuffled from round to round
    assert round_seed(b"r" * 20, 2, 7) != round_seed(b"r" * 20, 3, 7) != round_seed(b"s" * 20, 2, 7)


def test_batches_chain_joins_that_come_within_the_gap_of_each_other():
    # 100, 101.5, 103, 104.4: each within 2 s of the one before, so one batch, even though a
    # fixed 2 s window from 100 would have cut it after 101.5 and split the swarm in two
    times = {KEYS[0]: 100.0, KEYS[1]: 101.5, KEYS[2]: 103.0, KEYS[3]: 104.4, KEYS[4]: 110.0}
    assert batch_of(times, KEYS[0], 2.0, 7.0) == ([KEYS[0], KEYS[1], KEYS[2], KEYS[3]], 106.4)
    assert batch_of(times, KEYS[4], 2.0, 7.0) == ([KEYS[4]], 112.0)  # 5.6 s after the last: a new batch
    # every member of a batch computes the same batch and close time
    for k in KEYS[:4]:
        assert batch_of(times, k, 2.0, 7.0) == batch_of(times, KEYS[0], 2.0, 7.0)


def test_a_batch_never_stays_open_past_its_span():
    # a steady trickle of joins 1 s apart would chain forever; the span cuts it
    times = {KEYS[i]: 100.0 + i for i in range(8)}
    first, close = batch_of(times, KEYS[0], 2.0, 3.5)
    assert first == KEYS[:4] and close == 103.5  # 100..103; 104 is past 100 + 3.5
    second, close2 = batch_of(times, KEYS[5], 2.0, 3.5)
    assert second == KEYS[4:8] and close2 == 107.5  # 104..107, closes at its span (104 + 3.5)
    assert batch_of(times, KEYS[4], 2.0, 3.5) == (second, close2)


def test_group_id_binds_the_round_and_the_member_order():
    seed = round_seed(b"r" * 20, 0, 1)
    a = group_id_of(seed, (KEYS[0], KEYS[1]))
    assert len(a) == 16
    assert a != group_id_of(seed, (KEYS[1], KEYS[0]))
    assert a != group_id_of(round_seed(b"r" * 20, 0, 2), (KEYS[0], KEYS[1]))
    # the idle members are part of the group: another cut of the fragment is another group
    three = (KEYS[0], KEYS[1], KEYS[2])
    assert group_id_of(seed, three, (1,)) not in {group_id_of(seed, three), group_id_of(seed, three, (2,))}
    assert group_id_of(seed, three, (1,)) == group_id_of(seed, three, (1,))
