"""Which members of a finished round fail their part (peer.quiet): what marks a member quiet,
what clears it, and what marks nobody."""

from types import SimpleNamespace

from peer.quiet import CLEAR_AFTER, QUIET_GRACE, QuietMembers, grace

N, SIZE = 4, 10


def finished_round(me=0, pushed=None, got=None, reports=None, finals=(), banned=(), parts_held_by_others=()):
    """A finished round of four members as ``QuietMembers.judge`` reads it: by default every
    other member pushed all of our slice in time, sent us its part and reported."""
    pushed = [SIZE] * N if pushed is None else pushed
    got = [SIZE] * N if got is None else got
    reports = {i: tuple(b"d" if j in parts_held_by_others else b"" for j in range(N)) for i in range(N) if i != me} \
        if reports is None else reports
    return SimpleNamespace(n=N, me=me, peer_ids=[f"peer{i}" for i in range(N)], pushed=pushed, pushed_in_time=pushed,
                           got=got, reports=reports, finals=dict.fromkeys(finals, ()), banned=set(banned),
                           excluded=frozenset(), size=lambda j: SIZE, holds=lambda j: got[j] == SIZE)


def test_a_member_that_did_its_part_is_cleared_and_one_that_sent_nothing_is_marked():
    quiet = QuietMembers()
    rnd = finished_round(pushed=[SIZE, SIZE, SIZE, 0], got=[SIZE, SIZE, SIZE, 0],
                         reports={1: (b"",) * N, 2: (b"",) * N})
    assert quiet.judge(rnd) == [3]
    assert "peer3" in quiet and "peer1" not in quiet
    assert quiet.of(rnd.peer_ids, 0) == frozenset({3})
    for _ in range(CLEAR_AFTER - 1):  # whole rounds in a row clear it; a failure in between starts over
        assert quiet.judge(finished_round()) == [] and "peer3" in quiet
    assert quiet.judge(rnd) == [3]
    for _ in range(CLEAR_AFTER - 1):
        quiet.judge(finished_round())
    assert "peer3" in quiet
    quiet.judge(finished_round())
    assert "peer3" not in quiet


def test_pushing_and_then_neither_reducing_nor_reporting_is_failing():
    quiet = QuietMembers()
    got = [SIZE, 0, SIZE, SIZE]
    reports = {2: (b"",) * N, 3: (b"",) * N}
    assert quiet.judge(finished_round(got=got, reports=reports)) == [1]
    # its part reached another member (it reported holding it) and it reported: not failing
    assert quiet.judge(finished_round(got=got, parts_held_by_others=(1,))) == []
    # a final report stands for a report (it finished before our agreement began)
    assert quiet.judge(finished_round(reports={2: (b"",) * N, 3: (b"",) * N}, finals=(1,))) == []


def test_a_round_we_heard_nobody_in_marks_nobody_and_banned_members_are_left_to_the_bans():
    quiet = QuietMembers()
    silent = finished_round(pushed=[SIZE, 0, 0, 0], got=[SIZE, 0, 0, 0], reports={})
    assert quiet.judge(silent) == [] and len(quiet) == 0  # our own outage, or we are early
    assert quiet.judge(finished_round(pushed=[SIZE, SIZE, SIZE, 0], banned={"peer3"})) == []


def test_marks_are_bounded_and_the_grace_grows_with_the_others_time():
    quiet = QuietMembers(capacity=2)
    for k in range(5):
        rnd = finished_round(pushed=[SIZE, SIZE, SIZE, 0])
        rnd.peer_ids = [f"a{k}", f"b{k}", f"c{k}", f"ghost{k}"]
        quiet.judge(rnd)
    assert len(quiet) == 2 and "ghost4" in quiet and "ghost0" not in quiet
    assert grace(20.0, 0.3) == QUIET_GRACE * 20.0 and grace(20.0, 7.0) == 7.0
