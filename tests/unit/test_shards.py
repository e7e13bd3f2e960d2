"""Presence for many peers (peer.shards): where heartbeats go, what a node reads, the level it
settles at and the run's size it estimates, against a model DHT."""

import asyncio
import math
import random
from types import SimpleNamespace

import pytest

from peer.presence import RUNS_KEY, Presence, peers_key
from peer.shards import MAX_LEVEL, PROBE_EVERY, ShardView, shard_of, simulate
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages_swarm import Heartbeat, RunAdvertised

RUN = b"\x05" * 20


def keys(n, seed=0):
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


def test_shards_nest_level_by_level_and_level_zero_is_one_key():
    for k in keys(200):
        assert shard_of(RUN, k, 0) == 0
        for lv in range(1, MAX_LEVEL + 1):
            s = shard_of(RUN, k, lv)
            assert 0 <= s < 1 << lv
            assert s >> 1 == shard_of(RUN, k, lv - 1)  # a shard splits in two at the next level
    # another run deals the same keys out differently (a key's shard is not fixed for ever)
    assert [shard_of(RUN, k, 4) for k in keys(50)] != [shard_of(b"\x06" * 20, k, 4) for k in keys(50)]


def test_a_reader_one_level_off_from_a_writer_still_finds_it():
    writer, reader = keys(2)
    for lv in range(0, 8):
        w = ShardView(RUN, writer, level=lv)
        written = set(w.writes())
        assert {x for x, _ in written} == set(range(max(0, lv - 1), lv + 2))
        for off in (-1, 0, 1):
            if lv + off < 0:
                continue
            # whoever reads the writer's shard at a level one off from the writer's finds it
            assert (lv + off, shard_of(RUN, writer, lv + off)) in written


def test_reads_are_our_shard_and_a_few_others_drawn_afresh():
    me = keys(1)[0]
    v = ShardView(RUN, me, level=5, rng=random.Random(1), _reads=0)
    reads = [v.to_read() for _ in range(20)]
    for r in reads:
        assert r[0] == (5, shard_of(RUN, me, 5)) and len(r) == 3 and len(set(r)) == 3
    assert len({tuple(r[1:]) for r in reads}) > 10  # others drawn afresh every interval
    assert ShardView(RUN, me, level=0, _reads=0).to_read() == [(0, 0)]  # a small run: the one key


@pytest.mark.parametrize("n", [1, 20, 100, 1000])
def test_the_views_settle_within_a_level_of_the_right_one_and_estimate_the_run(n):
    got = simulate(n, 25)
    right = max(0, round(math.log2(max(n, 1) / 32)))
    assert all(abs(lv - right) <= 1 for lv in got.levels), got
    assert got.stores == (2 if set(got.levels) == {0} else 3)  # our shards at the levels around ours
    assert 0.5 <= got.estimate_low <= got.estimate_high <= 2.0, got
    if 1 < n <= 32:
        assert set(got.levels) == {0} and got.seen_share == 1.0  # a small run sees every peer


def test_what_a_node_reads_does_not_grow_with_the_run():
    small, large = simulate(200, 20), simulate(1600, 20)
    assert large.records_read < 1.6 * small.records_read
    assert large.records_read_max <= 3 * 2 * 32 * 1.5  # three shards of at most ~twice the target
    assert large.seen_share < 0.2  # a sample, not the whole run


def test_a_growing_run_moves_its_peers_up_level_by_level():
    got = simulate(800, 40, ramp=20)  # from one peer to 800 over 20 intervals
    assert set(got.levels) <= {4, 5}, got
    assert 0.5 <= got.estimate_low <= got.estimate_high <= 2.0


def test_a_newcomer_finds_a_large_run_at_its_level_in_one_probe():
    # a run of 2000 at level 6: every writer's shards at levels 5, 6 and 7
    writers = keys(2000, seed=3)
    store: dict[tuple[int, int], set[bytes]] = {}
    for k in writers:
        for where in ShardView(RUN, k, level=6).writes():
            store.setdefault(where, set()).add(k)
    me = keys(1, seed=99)[0]
    v = ShardView(RUN, me)
    assert v.probing()
    where = v.to_read()
    assert len(where) == MAX_LEVEL + 1  # its own shard at every level, in one read
    v.observe({w: len(store.get(w, set()) | {me}) for w in where})
    assert v.level in (5, 6, 7) and 1000 <= v.estimate <= 4000 and not v.probing()


def test_two_cohorts_two_levels_apart_find_each_other_at_the_next_probe():
    # 150 peers that started low (level 2) and 1000 at level 5 do not see each other where
    # they read; a probe of every level, every PROBE_EVERY reads, brings the low ones up
    store: dict[tuple[int, int], set[bytes]] = {}
    low, high = keys(150, seed=7), keys(1000, seed=8)
    for lv, ks in ((2, low), (5, high)):
        for k in ks:
            for where in ShardView(RUN, k, level=lv).writes():
                store.setdefault(where, set()).add(k)
    me = low[0]
    v = ShardView(RUN, me, level=2, rng=random.Random(2), _reads=0)
    for _ in range(PROBE_EVERY):
        assert not v.probing()
        v.observe({w: len(store.get(w, set()) | {me}) for w in v.to_read()})
        assert v.level == 2  # its own cohort fills its shards to the target: no reason to move
    assert v.probing()
    v.observe({w: len(store.get(w, set()) | {me}) for w in v.to_read()})
    assert v.level in (4, 5, 6) and v.estimate >= 800


def test_advertisers_are_about_a_target_of_a_large_run_and_all_of_a_small_one():
    ks = keys(4000, seed=5)
    assert all(ShardView(RUN, k, level=0).advertises() for k in ks[:50])
    n = sum(ShardView(RUN, k, level=7).advertises() for k in ks)  # 4000 / 2^7 ~ 31
    assert 10 <= n <= 60


def test_a_shard_target_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        ShardView(RUN, keys(1)[0], target=0)


class DictDHT:
    """hivemind's DHTNode as Presence uses it, in a dict (map records, no expiry)."""

    def __init__(self):
        self.records: dict[str, dict[bytes, bytes]] = {}

    async def store_many(self, keys, values, expiration, subkeys):
        for k, v, s in zip(keys, values, subkeys):
            self.records.setdefault(k, {})[s] = v
        return {k: True for k in keys}

    async def store(self, key, value, expiration, subkey):
        return (await self.store_many([key], [value], expiration, [subkey]))[key]

    async def get_many(self, keys, sufficient_expiration_time=None):
        return {k: SimpleNamespace(value={s: SimpleNamespace(value=v) for s, v in self.records[k].items()})
                if k in self.records else None for k in keys}


def heartbeat(run_id, now, step=1):
    return Heartbeat(run_id=run_id, sent_at=now, state="training", step=step, tokens=10, tokens_per_s=1.0,
                     rounds=(0, 0), state_digest=b"", reachable=True, maddrs=(), client="swarmstream/test",
                     device="cpu")


def test_presence_writes_three_levels_reads_its_shards_and_refuses_a_heartbeat_out_of_its_shard():
    dht, now = DictDHT(), 1e9
    ids = [Identity.generate() for _ in range(40)]
    pres = [Presence(dht, i, clock=lambda: now, shard_target=2) for i in ids]
    for _ in range(4):  # a few intervals: the views move up to where shards hold ~2 heartbeats
        for p in pres:
            asyncio.run(p.announce(heartbeat(RUN, now), 60))
        for p in pres:
            asyncio.run(p.peers(RUN, 60))
    for p in pres:  # each writes where its view now says
        asyncio.run(p.announce(heartbeat(RUN, now), 60))
    me = pres[0]
    lv = me.view(RUN).level
    assert lv >= 2 and 10 <= me.estimate(RUN) <= 160
    mine = {(level, shard) for level, shard in me.view(RUN).writes()}
    assert all(dht.records[peers_key(RUN, level, shard)].get(ids[0].public_key) for level, shard in mine)

    # a validly signed heartbeat stored in a shard its writer does not belong to is refused
    liar = Identity.generate()
    own = shard_of(RUN, ids[0].public_key, lv)
    while shard_of(RUN, liar.public_key, lv) == own:
        liar = Identity.generate()
    dht.records[peers_key(RUN, lv, own)][liar.public_key] = seal(heartbeat(RUN, now), liar)
    me.view(RUN)._reads = 0  # a plain read of our own shard and two others
    seen = asyncio.run(me.peers(RUN, 60))
    assert liar.public_key not in seen and me.rejected[liar.peer_id] == 1
    # a member outside the sample is found in its own shard
    other = next(i for i in ids[1:] if i.public_key not in seen)
    assert asyncio.run(me.heartbeat_of(RUN, other.public_key, 60)).step == 1


def test_only_the_peers_of_shard_zero_advertise_a_large_run():
    dht, now = DictDHT(), 1e9
    ids = [Identity.generate() for _ in range(64)]
    pres = [Presence(dht, i, clock=lambda: now, shard_target=2) for i in ids]
    for p in pres:
        p.view(RUN).level, p.view(RUN)._reads = 4, 0
        asyncio.run(p.advertise(RunAdvertised(run_id=RUN, sent_at=now, name="r", num_params=1, peers=64, step=1), 60))
    advertisers = {s[20:] for s in dht.records.get(RUNS_KEY, {})}
    assert advertisers == {i.public_key for i in ids if shard_of(RUN, i.public_key, 4) == 0}
