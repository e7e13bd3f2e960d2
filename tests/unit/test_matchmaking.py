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


def test_batches_are_windows_cut_greedily_from_the_earliest_join():
    times = {KEYS[0]: 100.0, KEYS[1]: 101.0, KEYS[2]: 102.0, KEYS[3]: 102.5, KEYS[4]: 110.0}
    assert batch_of(times, KEYS[0], 2.0) == ([KEYS[0], KEYS[1], KEYS[2]], 102.0)
    assert batch_of(times, KEYS[3], 2.0) == ([KEYS[3]], 104.5)  # 102.5 is past the first window
    assert batch_of(times, KEYS[4], 2.0) == ([KEYS[4]], 112.0)
    # every member of a batch computes the same batch and close time
    for k in (KEYS[0], KEYS[1], KEYS[2]):
        assert batch_of(times, k, 2.0) == batch_of(times, KEYS[0], 2.0)


def test_group_id_binds_the_round_and_the_member_order():
    seed = round_seed(b"r" * 20, 0, 1)
    a = group_id_of(seed, (KEYS[0], KEYS[1]))
    assert len(a) == 16
    assert a != group_id_of(seed, (KEYS[1], KEYS[0]))
    assert a != group_id_of(round_seed(b"r" * 20, 0, 2), (KEYS[0], KEYS[1]))
