"""peer.distrust: banned peers stay out, suspended ones come back after so many of our syncs,
and a peer suspended again stays out twice as long."""

import threading

from peer.distrust import Distrust

A, B, C = b"a" * 32, b"b" * 32, b"c" * 32


def _ticks(d: Distrust, n: int) -> None:
    for _ in range(n):
        d.tick()


def test_a_suspended_peer_is_back_when_its_suspension_ends_and_a_banned_one_never():
    d = Distrust(suspend=8, suspend_max=100)
    assert d.ban(A) and not d.ban(A)  # True only the first time
    assert d.suspend(B) == 8
    assert A in d and B in d and C not in d and d.active() == {A, B}
    _ticks(d, 7)
    assert B in d
    d.tick()
    assert B not in d and A in d and d.active() == {A}
    assert d.suspend(A) == 0  # banned already: a suspension changes nothing
    _ticks(d, 1000)
    assert A in d and d.banned(A) and not d.banned(B)


def test_each_suspension_lasts_twice_the_one_before_up_to_the_cap():
    d = Distrust(suspend=8, suspend_max=40)
    lengths = []
    for _ in range(5):
        lengths.append(d.suspend(A))
        d.tick()
        assert d.suspend(A) == 0 and A in d  # another verdict while it runs: the same incident
        _ticks(d, lengths[-1])
        assert A not in d
    assert lengths == [8, 16, 32, 40, 40]


def test_verdicts_from_two_threads_while_a_third_reads_and_ticks():
    d = Distrust(suspend=10_000)
    keys = [bytes([i]) * 32 for i in range(200)]

    def write(part):
        for k in part:
            d.suspend(k) if k[0] % 2 else d.ban(k)

    threads = [threading.Thread(target=write, args=(keys[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        d.tick()
        assert all(k in d for k in d.active())
    for t in threads:
        t.join()
    assert d.active() == set(keys)


def test_late_verdicts_on_groups_formed_before_a_suspension_are_the_same_incident():
    """Each part we held from a reducer is audited alike, each verdict comes an audit's timeout
    after its round, and groups form ahead of their rounds: verdicts on groups formed before
    the suspension began neither double it nor start another one once it ended."""
    d = Distrust(suspend=8, suspend_max=100)
    _ticks(d, 10)
    assert d.suspend(A, formed_at=9) == 8
    _ticks(d, 3)
    assert d.suspend(A, formed_at=9) == 0 and d.suspend(A, formed_at=11) == 0 and A in d  # not extended
    _ticks(d, 5)
    assert A not in d
    assert d.suspend(A, formed_at=9) == 0 and A not in d  # over: a group formed before it does not start another
    assert d.suspend(A, formed_at=10) == 0 and A not in d  # nor one formed at the count it began at
    assert d.suspend(A, formed_at=18) == 16 and A in d  # one formed after it: the second suspension, twice as long


def test_each_suspend_max_syncs_without_an_incident_forgive_one():
    d = Distrust(suspend=8, suspend_max=64)
    assert d.suspend(A) == 8
    _ticks(d, 100)
    assert d.suspend(A) == 8  # 100 syncs later: one of one incident forgiven
    _ticks(d, 10)
    assert d.suspend(A) == 16  # 10 syncs later: nothing forgiven
    _ticks(d, 200)
    assert d.suspend(A) == 8  # 200 syncs (3 x 64) later: both forgiven
