"""A ``GroupFormed`` record is a claim, not a fact: any key can write one naming anyone. A peer
follows its own leader's record (by its view of the joins), or one that is the group the batch
rule gives its leader over the joins it reads; never a key that names whom it likes
(``Matchmaker._mine``). Found by an adversarial review: a key that never joined wrote records
naming one member of each honest group, and those members followed it (ranked first) while
their groups waited for them; naming a leader left that leader's followers alone."""

import asyncio
import dataclasses
import time

import pytest

from peer.matchmaking import Matchmaker, assign_groups, group_id_of, groups_key, joins_key, rank, round_seed
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.manifest import SwarmConfig
from protocol.messages_swarm import GroupFormed, JoinGroup
from test_align import NUMEL, RUN_ID, MemoryDHT

T, ROUND = 1.0, 7
SEED = round_seed(RUN_ID, 0, ROUND)


def keys_ranked(n: int, first: bool) -> tuple[list[Identity], Identity]:
    """``n`` honest keys and a liar's key ranked before (``first``) or after all of them."""
    pool = sorted((Identity.generate() for _ in range(n + 8)), key=lambda i: rank(SEED, i.public_key))
    liar = pool[0] if first else pool[-1]
    return [i for i in pool if i is not liar][:n], liar


def record(liar: Identity, members: tuple[bytes, ...], weights: tuple[float, ...], group_size: int) -> GroupFormed:
    return GroupFormed(run_id=RUN_ID, fragment=0, round=ROUND, group_id=group_id_of(SEED, members), members=members,
                       weights=weights, numel=NUMEL, codec="fp32", deadline_s=SwarmConfig().allreduce_timeout_s)


async def form(honest: list[Identity], dht: MemoryDHT, group_size: int) -> list[tuple[bytes, ...] | None]:
    sw = SwarmConfig(matchmaking_timeout_s=T, group_size=group_size)
    mms = [Matchmaker(dht, h, RUN_ID, sw, poll_s=0.05) for h in honest]
    got = await asyncio.gather(*(m.form_group(0, ROUND, 1.0, NUMEL, "fp32") for m in mms))
    return [None if g is None else g.members for g in got]


@pytest.mark.parametrize("joined", [False, True])
def test_a_key_that_names_members_of_other_groups_is_not_followed(joined):
    """The liar ranks before every honest key and names one member of each honest group (and
    a leader), with itself first; joined or not, every honest peer ends in its own group."""
    honest, liar = keys_ranked(6, first=True)
    dht = MemoryDHT()
    now = time.time()
    if joined:  # its join is real: it is then in the batch, and in the one group the rule gives it
        asyncio.run(dht.store(joins_key(RUN_ID, 0, ROUND), seal(JoinGroup(run_id=RUN_ID, fragment=0, round=ROUND,
                    weight=1.0, numel=NUMEL), liar), now + 2 * T, subkey=liar.public_key))
    keys = [h.public_key for h in honest] + ([liar.public_key] if joined else [])
    rightful = assign_groups(SEED, keys, 3)
    victims = tuple(sorted((g[0] if i == 0 else g[-1] for i, g in enumerate(rightful) if liar.public_key not in g),
                           key=lambda k: rank(SEED, k)))
    forged = record(liar, (liar.public_key, *victims), (1.0,) * (1 + len(victims)), 3)
    asyncio.run(dht.store(groups_key(RUN_ID, 0, ROUND), seal(forged, liar), now + 100, subkey=liar.public_key))
    got = asyncio.run(form(honest, dht, 3))
    for h, members in zip(honest, got):
        own = next(g for g in rightful if h.public_key in g)
        if liar.public_key in own:  # led by the liar, which wrote no record of its group: the rest go
            assert members == (own[1:] if len(own) >= 3 else None)  # on without it (a pair's other: alone)
        else:  # in its own group, whatever the liar wrote
            assert members == own, (members, own)


@pytest.mark.parametrize("wrote", ["nothing", "a record we refuse"])
def test_the_rest_of_a_group_whose_leader_wrote_no_record_to_follow_average_without_it(wrote):
    """A key ranked first joins and then writes no record (or one that fails our checks): by
    their deadline its followers used to give up and average alone, apart. Now the member
    ranked next leads the rest: every one of them follows one record, and they keep their
    weights."""
    honest, liar = keys_ranked(4, first=True)
    dht = MemoryDHT()
    now = time.time()
    asyncio.run(dht.store(joins_key(RUN_ID, 0, ROUND), seal(JoinGroup(run_id=RUN_ID, fragment=0, round=ROUND,
                weight=1.0, numel=NUMEL), liar), now + 2 * T, subkey=liar.public_key))
    everyone = tuple(sorted([liar.public_key] + [h.public_key for h in honest], key=lambda k: rank(SEED, k)))
    assert everyone[0] == liar.public_key
    if wrote != "nothing":  # its group, but with a deadline that is not the run's: refused
        bad = dataclasses.replace(record(liar, everyone, (1.0,) * 5, 8), deadline_s=1.0)
        asyncio.run(dht.store(groups_key(RUN_ID, 0, ROUND), seal(bad, liar), now + 100, subkey=liar.public_key))
    sw = SwarmConfig(matchmaking_timeout_s=T, group_size=8)
    mms = [Matchmaker(dht, h, RUN_ID, sw, poll_s=0.05) for h in honest]

    async def all_form():
        return await asyncio.gather(*(m.form_group(0, ROUND, 1.0, NUMEL, "fp32") for m in mms))

    got = asyncio.run(all_form())
    assert all(g is not None for g in got), got
    assert {(g.members, g.group_id, g.idle, g.weights) for g in got} == {
        (everyone[1:], group_id_of(SEED, everyone[1:]), (), (1.0,) * 4)}


def test_the_rest_of_a_group_whose_leader_we_banned_after_the_batch_average_without_it():
    """Found by a review's whole-node runs: a liar ranked first was in the batch, wrote a valid
    record of the whole group, and was banned (an audit's proof handed on) while its followers
    waited for that record: they refused it, and counted every member it named as taken by it,
    so nobody was left to go on with and each averaged alone (three copies apart, then
    repairs). A record of a leader we distrust takes nobody: the rest go on without it."""
    honest, liar, dht, everyone, now = _joined_liar_first(4)
    full = record(liar, everyone, (1.0,) * 5, 8)
    asyncio.run(dht.store(groups_key(RUN_ID, 0, ROUND), seal(full, liar), now + 100, subkey=liar.public_key))
    sw = SwarmConfig(matchmaking_timeout_s=T, group_size=8)
    mms = [Matchmaker(dht, h, RUN_ID, sw, poll_s=0.05) for h in honest]
    for mm in mms:  # the ban comes once the batch is formed, before the leader's record is read
        mine = mm._mine

        async def banning(*args, _mm=mm, _mine=mine, **kw):
            _mm.distrusted.ban(liar.public_key)
            return await _mine(*args, **kw)
        mm._mine = banning

    async def all_form():
        return await asyncio.gather(*(m.form_group(0, ROUND, 1.0, NUMEL, "fp32") for m in mms))

    got = asyncio.run(all_form())
    assert all(g is not None for g in got), got
    assert {g.members for g in got} == {everyone[1:]}


def _joined_liar_first(n_honest: int):
    honest, liar = keys_ranked(n_honest, first=True)
    dht = MemoryDHT()
    now = time.time()
    for k in (liar, *honest):
        asyncio.run(dht.store(joins_key(RUN_ID, 0, ROUND), seal(JoinGroup(run_id=RUN_ID, fragment=0, round=ROUND,
                    weight=1.0, numel=NUMEL), k), now + 2 * T, subkey=k.public_key))
    everyone = tuple(sorted([liar.public_key] + [h.public_key for h in honest], key=lambda k: rank(SEED, k)))
    assert everyone[0] == liar.public_key
    return honest, liar, dht, everyone, now


def _all_form(honest, dht):
    sw = SwarmConfig(matchmaking_timeout_s=T, group_size=8)
    mms = [Matchmaker(dht, h, RUN_ID, sw, poll_s=0.05) for h in honest]

    async def go():
        return await asyncio.gather(*(m.form_group(0, ROUND, 1.0, NUMEL, "fp32") for m in mms))

    return asyncio.run(go())


def test_a_leader_whose_record_leaves_out_the_member_ranked_next_does_not_strand_it():
    """The leader's record names every member but the one ranked second: the others follow
    it, and the second, whose would-be group the record took, averages alone (as before)
    instead of leading a group nobody joins and waiting the all-reduce's deadline in it."""
    honest, liar, dht, everyone, now = _joined_liar_first(4)
    named = (everyone[0], *everyone[2:])
    asyncio.run(dht.store(groups_key(RUN_ID, 0, ROUND), seal(record(liar, named, (1.0,) * 4, 8), liar), now + 100,
                          subkey=liar.public_key))
    got = {h.public_key: g for h, g in zip(honest, _all_form(honest, dht))}
    assert got[everyone[1]] is None
    assert all(got[k] is not None and got[k].members == named for k in everyone[2:])


@pytest.mark.parametrize("lie", ["a stranger", "a heavier weight"])
def test_the_member_ranked_next_gets_no_more_say_than_the_rest_of_the_group(lie):
    """The leader wrote nothing, and the member ranked second (a liar too) writes a record of
    "the rest" early with a key that is not in our group, or with its own weight raised: no
    member follows it; each averages alone when nothing else comes (as before)."""
    honest, liar, dht, everyone, now = _joined_liar_first(3)
    second = next(h for h in honest if h.public_key == everyone[1])
    stranger = Identity.generate().public_key
    if lie == "a stranger":
        members, weights = (*everyone[1:], stranger), (1.0,) * 4
    else:
        members, weights = everyone[1:], (1e6, 1.0, 1.0)
    forged = GroupFormed(run_id=RUN_ID, fragment=0, round=ROUND, group_id=group_id_of(SEED, members), members=members,
                         weights=weights, numel=NUMEL, codec="fp32", deadline_s=SwarmConfig().allreduce_timeout_s)
    asyncio.run(dht.store(groups_key(RUN_ID, 0, ROUND), seal(forged, second), now + 100, subkey=second.public_key))
    others = [h for h in honest if h is not second]
    assert _all_form(others, dht) == [None, None]


def test_a_leader_whose_view_was_fuller_is_followed_once_its_extra_join_is_read():
    """Views differ: the leader saw a join we had not read when our window closed. Its record
    is not what our view gives, but it is once we read the joins again: we follow it."""
    honest, _ = keys_ranked(3, first=True)
    dht = MemoryDHT()
    sw = SwarmConfig(matchmaking_timeout_s=T, group_size=8)
    now = time.time()
    for h in honest:
        asyncio.run(dht.store(joins_key(RUN_ID, 0, ROUND), seal(JoinGroup(run_id=RUN_ID, fragment=0, round=ROUND,
                    weight=1.0, numel=NUMEL), h), now + 2 * T, subkey=h.public_key))
    lead, _, me = sorted(honest, key=lambda i: rank(SEED, i.public_key))
    full = tuple(sorted((h.public_key for h in honest), key=lambda k: rank(SEED, k)))
    mm = Matchmaker(dht, me, RUN_ID, sw, poll_s=0.05)
    # our reads of the joins in the window miss the leader's (a late store): by our view, the
    # second peer leads our group, and the leader's record is not our leader's
    third = lead
    hidden = {"on": True}
    real_read, real_mine = mm._read_joins, mm._mine

    async def late_read(*a):
        joins = await real_read(*a)
        if hidden["on"]:  # the window's reads
            joins.pop(third.public_key, None)
        return joins

    async def then_mine(*a):
        hidden["on"] = False  # the store has landed by the time we look for our group
        return await real_mine(*a)

    mm._read_joins, mm._mine = late_read, then_mine
    asyncio.run(dht.store(groups_key(RUN_ID, 0, ROUND), seal(record(lead, full, (1.0,) * 3, 8), lead), now + 100,
                          subkey=lead.public_key))
    got = asyncio.run(mm.form_group(0, ROUND, 1.0, NUMEL, "fp32"))
    assert got is not None and got.members == full


def test_a_leader_gives_its_quiet_members_no_slice_and_every_member_takes_the_same_cut():
    """``GroupFormed.idle``: the leader names the members that pushed nothing in its last round
    with them (``peer.quiet``), up to a third; every member forms that group, the same ID and
    the same idle set, and a quiet member the leader did not mark still reduces."""
    honest, _ = keys_ranked(6, first=True)
    dht = MemoryDHT()
    sw = SwarmConfig(matchmaking_timeout_s=T, group_size=8)
    mms = [Matchmaker(dht, h, RUN_ID, sw, poll_s=0.05) for h in honest]
    order = sorted(honest, key=lambda i: rank(SEED, i.public_key))
    quiet = {order[2].peer_id, order[4].peer_id, order[5].peer_id}  # the leader's marks: more than a third
    mms[honest.index(order[0])].quiet = quiet.__contains__
    for m in mms:  # the followers' own marks do not matter: the leader's record is the group
        m.quiet = m.quiet or (lambda peer_id: True)

    async def all_form():
        return await asyncio.gather(*(m.form_group(0, ROUND, 1.0, NUMEL, "fp32") for m in mms))

    got = asyncio.run(all_form())
    assert {(g.members, g.group_id, g.idle) for g in got} == {(got[0].members, got[0].group_id, (2, 4))}
    assert got[0].group_id == group_id_of(SEED, got[0].members, (2, 4))


def test_a_record_whose_id_does_not_cover_its_idle_members_is_refused():
    """Two records of one group ID must cut the fragment alike: the ID is the hash of the
    members and the idle set, so a leader naming an idle set its ID does not cover is not
    followed (its followers would refuse each other's frames as off their slices)."""
    honest, _ = keys_ranked(3, first=True)
    lead, *followers = sorted(honest, key=lambda i: rank(SEED, i.public_key))
    members = tuple(i.public_key for i in (lead, *followers))
    forged = dataclasses.replace(record(lead, members, (1.0,) * 3, 8), idle=(1,))  # the ID is of no idle set
    fair = dataclasses.replace(forged, group_id=group_id_of(SEED, members, (1,)))

    def follow(rec: GroupFormed):
        dht, now = MemoryDHT(), time.time()
        for h in honest:
            asyncio.run(dht.store(joins_key(RUN_ID, 0, ROUND), seal(JoinGroup(
                run_id=RUN_ID, fragment=0, round=ROUND, weight=1.0, numel=NUMEL), h), now + 2 * T, subkey=h.public_key))
        asyncio.run(dht.store(groups_key(RUN_ID, 0, ROUND), seal(rec, lead), now + 100, subkey=lead.public_key))
        mm = Matchmaker(dht, followers[0], RUN_ID, SwarmConfig(matchmaking_timeout_s=T, group_size=8), poll_s=0.05)
        return asyncio.run(mm.form_group(0, ROUND, 1.0, NUMEL, "fp32"))

    refused = follow(forged)  # not followed: we lead the rest of the group without it (ranked next)
    assert refused is not None and refused.members == members[1:] and refused.idle == ()
    got = follow(fair)
    assert got is not None and got.idle == (1,) and got.members == members


class _LateRecord:
    """A leader's view of the DHT in which its group record lands ``after`` seconds after
    every member's deadline (its network thread stalled under load)."""

    def __init__(self, dht: MemoryDHT, after: float):
        self.dht, self.after, self.mm = dht, after, None

    async def store(self, key, value, expiration, subkey):
        if key == groups_key(RUN_ID, 0, ROUND):
            joins = await self.mm._read_joins(0, ROUND, NUMEL, time.time())
            latest = max(j.joined_at for j in joins.values()) + T
            await asyncio.sleep(max(0.0, latest + self.after - time.time()))
        return await self.dht.store(key, value, expiration, subkey)

    async def get(self, key, latest=True):
        return await self.dht.get(key, latest)


class _SlowReads:
    """A member's view of the group records, ``lag`` seconds behind (a slow link)."""

    def __init__(self, dht: MemoryDHT, lag: float):
        self.dht, self.lag = dht, lag

    async def store(self, *args, **kwargs):
        return await self.dht.store(*args, **kwargs)

    async def get(self, key, latest=True):
        if key == groups_key(RUN_ID, 0, ROUND):
            await asyncio.sleep(self.lag)
        return await self.dht.get(key, latest)


@pytest.mark.parametrize("late_by, lag, skew", [(None, 0.0, 0.0), (2.5, 0.0, 0.0), (0.08, 0.15, 0.0), (0.08, 0.0, 0.0),
                                                (0.02, 0.0, -0.1)])
def test_a_leader_whose_record_came_after_its_members_deadlines_does_not_wait_in_a_group_nobody_joined(late_by, lag,
                                                                                                       skew):
    """CI: the leader's network thread stalled; its record was stored after its followers'
    deadlines, the member ranked next led the others, and the leader followed its own record
    into a group nobody joined, a whole agreement long. Now it sees the others' record and
    averages alone; on time, it leads as before. Just after the deadlines, a member whose
    read of the records lags sees the leader's while the member ranked next did not (a
    review's race): it takes the others' record too, so nobody is in a group some of whose
    members went elsewhere; so does one whose clock is behind (``skew``), that read the record
    just before the deadline by its clock (a review's simulation)."""
    honest, _ = keys_ranked(4, first=True)
    dht = MemoryDHT()
    sw = SwarmConfig(matchmaking_timeout_s=T, group_size=8)
    views = [dht if late_by is None else _LateRecord(dht, late_by), dht, dht, _SlowReads(dht, lag) if lag else dht]
    mms = [Matchmaker(v, h, RUN_ID, sw, poll_s=0.05) for v, h in zip(views, honest)]
    if late_by is not None:
        views[0].mm = mms[0]

    clocks = [time.time] * 3 + [lambda: time.time() + skew]

    async def go():
        return await asyncio.gather(*(m.form_group(0, ROUND, 1.0, NUMEL, "fp32", now=c) for m, c in zip(mms, clocks)))

    got = dict(zip((h.public_key for h in honest), asyncio.run(go())))
    everyone = tuple(sorted(got, key=lambda k: rank(SEED, k)))
    assert honest[0].public_key == everyone[0]
    for g in got.values():  # every member of a group is in it
        assert g is None or all(got[m] is not None and got[m].group_id == g.group_id for m in g.members), got
    if late_by is None:
        assert {g.members for g in got.values()} == {everyone}
    elif late_by > 1:
        assert got[everyone[0]] is None and {g.members for g in list(got.values())[1:]} == {everyone[1:]}


def test_a_pairs_leader_whose_record_came_after_its_partners_deadline_knows_its_group_is_late():
    """In a pair nobody leads the rest: the partner averages alone at its deadline, and the
    leader, whose record came after it, finds nothing to follow. Its group says so
    (``Group.late``), and its round then does not wait for the partner's report as if it
    were early (``Round.took_part``): one deadline alone, not 2.5 of them."""
    honest, _ = keys_ranked(2, first=True)
    for late_by in (None, 2.5):
        dht = MemoryDHT()
        sw = SwarmConfig(matchmaking_timeout_s=T, group_size=8)
        views = [dht if late_by is None else _LateRecord(dht, late_by), dht]
        mms = [Matchmaker(v, h, RUN_ID, sw, poll_s=0.05) for v, h in zip(views, honest)]
        if late_by is not None:
            views[0].mm = mms[0]

        async def go(mms=mms):
            return await asyncio.gather(*(m.form_group(0, ROUND, 1.0, NUMEL, "fp32") for m in mms))

        lead, partner = asyncio.run(go())
        if late_by is None:
            assert lead.members == partner.members and not lead.late and not partner.late
        else:
            assert partner is None and lead.late
