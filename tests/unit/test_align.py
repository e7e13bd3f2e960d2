"""A peer ahead of the others waits for them at its next round (``Matchmaker.align_delay``),
also when they are about a whole round behind, so that their join of our lonely round is not
readable yet when we join the next one. An in-memory DHT stands in for hivemind's (the same
``store``/``get`` with subkeys and expirations); the joins are real signed records."""

import asyncio
from dataclasses import dataclass

import pytest

from peer.matchmaking import Matchmaker, assign_groups, joins_key, round_seed
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.manifest import SwarmConfig
from protocol.messages_swarm import JoinGroup

RUN_ID = bytes(range(20))
NUMEL = 64
T = 5.0  # matchmaking_timeout_s


@dataclass
class _Value:
    value: bytes
    expiration_time: float


@dataclass
class _Found:
    value: dict


class MemoryDHT:
    def __init__(self):
        self.records: dict[str, dict[bytes, _Value]] = {}

    async def store(self, key, value, expiration, subkey):
        self.records.setdefault(key, {})[subkey] = _Value(value, expiration)
        return True

    async def get(self, key, latest=True):
        found = self.records.get(key)
        return _Found(dict(found)) if found else None


ME, OTHER = Identity.generate(), Identity.generate()


def matchmaker(dht) -> Matchmaker:
    return Matchmaker(dht, ME, RUN_ID, SwarmConfig(matchmaking_timeout_s=T), poll_s=0.1)


def join(dht, mm: Matchmaker, who: Identity, round_: int, at: float) -> None:
    msg = JoinGroup(run_id=RUN_ID, fragment=0, round=round_, weight=1.0, numel=NUMEL)
    asyncio.run(dht.store(joins_key(RUN_ID, 0, round_), seal(msg, who), at + mm.join_ttl_s,
                          subkey=who.public_key))


def delay(mm: Matchmaker, round_: int, now: float) -> float:
    return asyncio.run(mm.align_delay(0, round_, NUMEL, now=lambda: now))


def test_a_peer_behind_by_part_of_a_round_is_waited_for_by_its_offset():
    dht = MemoryDHT()
    mm = matchmaker(dht)
    mm._alone[0] = {4: 100.0}  # we averaged round 4 alone, joined at 100
    join(dht, mm, ME, 4, 100.0)
    join(dht, mm, OTHER, 4, 102.5)  # they came 2.5 s later
    assert delay(mm, 5, now=104.0) == pytest.approx(2.5)


def test_a_peer_a_round_behind_is_waited_for_by_the_lonely_round_before():
    """Round period 4 s, the other 4.2 s behind: when we join round 6 (at 108), its join of
    round 5 is still to come; its join of round 4 tells the offset."""
    dht = MemoryDHT()
    mm = matchmaker(dht)
    mm._alone[0] = {4: 100.0, 5: 104.0}
    for r, t in ((4, 100.0), (5, 104.0)):
        join(dht, mm, ME, r, t)
    join(dht, mm, OTHER, 4, 104.2)
    assert delay(mm, 6, now=108.0) == pytest.approx(4.2)


def test_what_we_waited_since_counts_and_the_wait_is_bounded():
    dht = MemoryDHT()
    mm = matchmaker(dht)
    mm._alone[0] = {4: 100.0}
    join(dht, mm, OTHER, 4, 109.0)  # 9 s behind: we wait at most T now ...
    assert delay(mm, 5, now=104.0) == pytest.approx(T)
    mm._alone[0][5] = 104.0 + T  # ... still alone at round 5 (its join not readable yet),
    assert delay(mm, 6, now=113.0) == pytest.approx(9.0 - T)  # so the rest at round 6


def test_no_wait_when_the_others_came_earlier_or_we_were_not_alone():
    dht = MemoryDHT()
    mm = matchmaker(dht)
    mm._alone[0] = {3: 96.0, 4: 100.0}
    join(dht, mm, OTHER, 4, 99.0)  # they are ahead: they wait, not we
    join(dht, mm, OTHER, 3, 97.0)  # (an older round is not looked at once a newer one is read)
    assert delay(mm, 5, now=104.0) == 0.0
    assert delay(mm, 7, now=112.0) == 0.0  # round 6 was not lonely: nothing to align


def test_nothing_readable_in_any_lonely_round_means_no_wait():
    mm = matchmaker(MemoryDHT())
    mm._alone[0] = {2: 92.0, 3: 96.0, 4: 100.0}
    assert delay(mm, 5, now=104.0) == 0.0


def test_a_peer_rounds_behind_is_not_waited_for_it_downloads_instead():
    """Round period 4 s, the other 9 s behind (two rounds and a bit, as after a pause): not
    out of step but rounds behind; waiting for it would keep it from falling far enough behind
    to download the swarm's state."""
    dht = MemoryDHT()
    mm = matchmaker(dht)
    mm._alone[0] = {4: 100.0, 5: 104.0}
    join(dht, mm, OTHER, 4, 109.0)
    assert delay(mm, 6, now=108.0) == 0.0


def _leader_and_other(round_: int) -> tuple[Identity, Identity]:
    first = assign_groups(round_seed(RUN_ID, 0, round_), [ME.public_key, OTHER.public_key], 8)[0][0]
    return (ME, OTHER) if first == ME.public_key else (OTHER, ME)


class CountingDHT(MemoryDHT):
    def __init__(self):
        super().__init__()
        self.join_reads = 0

    async def get(self, key, latest=True):
        self.join_reads += key.endswith("/joins")
        return await super().get(key, latest)


@pytest.mark.parametrize("expect_other", [True, False])
def test_a_batch_closes_as_soon_as_every_expected_peer_is_in_it(expect_other):
    """The batch window (gap + settle after the last join) is a floor under every sync. Once
    every peer the node expects has joined, the batch closes at once: one read of the joins,
    and the group is formed. Expecting nobody (or a peer that has not joined), the window runs
    as before: the joins are read again until it closes."""
    dht = CountingDHT()
    leader, other = _leader_and_other(7)
    mm = Matchmaker(dht, leader, RUN_ID, SwarmConfig(matchmaking_timeout_s=T), poll_s=0.01)
    clock = [1000.0]

    def now() -> float:
        clock[0] += 0.01  # the DHT clock moves a little at every look, as it does
        return clock[0]

    join(dht, mm, other, 7, 1000.0)
    mm.expected = (lambda f, r: {other.public_key}) if expect_other else (lambda f, r: {Identity.generate().public_key})
    group = asyncio.run(mm.form_group(0, 7, 1.0, NUMEL, "fp32", now=now))
    assert group is not None and set(group.members) == {leader.public_key, other.public_key}
    if expect_other:
        assert dht.join_reads == 1
    else:
        assert dht.join_reads > 10  # polled until gap + settle after the last join


def test_one_key_joining_just_under_a_timeout_later_does_not_set_the_wait():
    """Found by an adversarial review: the wait followed the latest join of our lonely round,
    so one key's join dated just under T after ours kept us waiting T, missing the others'
    batch, alone again, every round. The wait goes to where most of them joined."""
    dht = MemoryDHT()
    mm = matchmaker(dht)
    mm._alone[0] = {4: 100.0}
    join(dht, mm, ME, 4, 100.0)
    for k in range(2):  # the others, together, 1.5 s after us
        join(dht, mm, Identity.from_seed(bytes([0x40 + k]) * 32), 4, 101.5 + 0.1 * k)
    join(dht, mm, Identity.from_seed(b"\x66" * 32), 4, 100.0 + T - 0.05)  # the liar
    assert delay(mm, 5, now=104.0) == pytest.approx(1.5)
