"""A reducer that sends different means of its part to different members: the two signed
frames prove it (protocol.evidence.equivocation), the members that see the dispute exchange
their frames and fall back on the part alike (peer.allreduce_round), and the proof bans the
reducer across restarts (peer.bans). No network: frames go from one Round to another by hand."""

import asyncio
import dataclasses

import torch

from peer.allreduce import Group
from peer.allreduce_round import Round
from peer.bans import Bans
from protocol.codecs import get_codec
from protocol.envelope import seal, verify
from protocol.evidence import equivocation, proves
from protocol.identity import Identity
from protocol.messages import digest
from protocol.messages_swarm import PartsHeld, PushSlice, SliceAveraged

RUN = b"\x05" * 20
GID = b"g" * 16
N = 4
KEYS = [Identity.from_seed(bytes([0x20 + i]) * 32) for i in range(N)]
NUMEL = 10 * N  # parts of 10


def mean(values: torch.Tensor, part: int = 0, offset: int = 0, signer: Identity = KEYS[0], round_: int = 1,
         contributors: tuple = tuple(range(N))) -> bytes:
    return seal(SliceAveraged(run_id=RUN, fragment=0, round=round_, group_id=GID, part=part, offset=offset,
                              numel=values.numel(), shape=(values.numel(),), dtype="float32", codec="fp32",
                              weight=float(len(contributors)), contributors=contributors, inputs=b"i" * 32,
                              own=digest(get_codec("fp32").encode(values)),
                              payload=get_codec("fp32").encode(values)), signer)


ONES, TWOS = torch.ones(10), torch.full((10,), 2.0)


def test_two_different_signed_means_of_one_part_prove_equivocation():
    key, why = equivocation(mean(ONES), mean(TWOS), RUN)
    assert key == KEYS[0].public_key and "two different means" in why
    assert proves([mean(ONES), mean(TWOS)], RUN)[0] == KEYS[0].public_key
    # the same mean twice (a resend) proves nothing; nor do two chunks of one part
    assert equivocation(mean(ONES), mean(ONES), RUN) is None
    assert equivocation(mean(ONES[:5]), mean(TWOS[:5], offset=5), RUN) is None
    # nor means of two rounds, two parts, two signers, another run's, or a broken signature
    assert equivocation(mean(ONES), mean(TWOS, round_=2), RUN) is None
    assert equivocation(mean(ONES), mean(TWOS, part=1, offset=10), RUN) is None
    assert equivocation(mean(ONES), mean(TWOS, signer=KEYS[1]), RUN) is None
    assert equivocation(mean(ONES), mean(TWOS), b"\x06" * 20) is None
    assert equivocation(mean(ONES), mean(TWOS)[:-1] + b"\x00", RUN) is None
    # the same values with other contributors is another mean too; another weight alone is not
    # (a member's digest of the part covers contributors and values: the weight follows from them)
    assert equivocation(mean(ONES), mean(ONES, contributors=(0, 1)), RUN) is not None
    heavier = seal(dataclasses.replace(verify(mean(ONES)).message, weight=4.0000000001), KEYS[0])
    assert equivocation(mean(ONES), heavier, RUN) is None


def test_an_equivocation_ban_holds_after_a_restart(tmp_path):
    bans = Bans(tmp_path / "bans", RUN)
    assert not bans.add(KEYS[1].public_key, "x", (mean(ONES), mean(TWOS)))  # not against KEYS[1]
    assert bans.add(KEYS[0].public_key, "x", (mean(ONES), mean(TWOS)))
    assert (tmp_path / "bans" / f"{KEYS[0].peer_id}.frames").exists()
    again = Bans(tmp_path / "bans", RUN)
    again.load()
    assert again.peer_ids == {KEYS[0].peer_id} and "two different means" in again.reason(KEYS[0].public_key)
    (tmp_path / "bans" / f"{KEYS[0].peer_id}.frames").write_bytes(b"\x92\xc4\x01a")  # truncated: proves nothing
    third = Bans(tmp_path / "bans", RUN)
    third.load()
    assert len(third) == 0


def member(me: int) -> Round:
    group = Group(run_id=RUN, fragment=0, round=1, group_id=GID, members=tuple(k.public_key for k in KEYS),
                  weights=(1.0,) * N, numel=NUMEL, codec="fp32", deadline_s=5.0)
    rnd = Round(group, me, torch.zeros(NUMEL), get_codec("fp32"))
    rnd.collecting_pushes = False
    return rnd


def deliver(rnd: Round, frame: bytes, via: int | None = None) -> None:
    """``frame`` reaches ``rnd`` from its signer, or forwarded by member ``via``."""
    v = verify(frame)
    if via is None:
        rnd.accept(v.peer_id, v, len(frame), frame)
    else:
        rnd.accept_forwarded(KEYS[via].peer_id, v, len(frame), frame)


def hold(rnd: Round, j: int, values: torch.Tensor) -> None:
    """``rnd`` holds part j: its own, reduced, or the reducer's frame received."""
    frame = mean(values, part=j, offset=10 * j, signer=KEYS[j])
    if j == rnd.me:
        rnd.own([(10 * j, 10 * j + 10, get_codec("fp32").encode(values))], [])  # as it averaged it: its mean's bytes
        rnd.reduced(tuple(range(N)), [(10 * j, 10 * j + 10, get_codec("fp32").encode(values))], [[frame]])
    else:
        deliver(rnd, frame)


def report(rnd: Round) -> bytes:
    return seal(PartsHeld(run_id=RUN, fragment=0, round=1, group_id=GID, digests=rnd.digests()), KEYS[rnd.me])


def test_members_holding_different_means_exchange_them_and_both_fall_back_on_the_part():
    async def run():
        a, b = member(1), member(2)  # honest; member 0 reduces part 0 and lies
        for rnd, values in ((a, ONES), (b, TWOS)):
            deliver(rnd, mean(values))
            for j in range(1, N):
                hold(rnd, j, torch.full((10,), 3.0 + j))
            rnd.agreeing = True
            rnd.reported = rnd.digests()  # as Averager._agree does when it sends the report
        ra, rb = report(a), report(b)
        deliver(a, rb)
        deliver(b, ra)
        assert a.unproven() == [0] and b.unproven() == [0] and not a.agreed()
        # each forwards its frames of part 0 to the other, whose digest differs
        assert (2, 0) in a.forward_wanted() and (1, 0) in b.forward_wanted()
        assert (2, 1) not in a.forward_wanted()  # the same digest: nothing to forward
        for rnd, other, via in ((a, b, 2), (b, a, 1)):
            for frames in other.frames[0]:
                deliver(rnd, frames[0], via=via)
        for rnd in (a, b):
            assert 0 in rnd.convicted and rnd.unproven() == []
            assert [o[0] for o in rnd.offences.values()] == [KEYS[0].public_key]
            assert proves(rnd.convicted[0], RUN)[0] == KEYS[0].public_key
            assert rnd.visible(0)  # the reports showed it: every member waited for the proof
        # the proof goes to every member that reported holding the part
        assert a.proof_wanted() == [(2, 0)] and b.proof_wanted() == [(1, 0)]

    asyncio.run(run())


def test_a_member_dropped_for_a_bad_push_still_has_its_means_taken_and_its_equivocation_proven():
    """The liar's push, off the run's grid of chunks, reaches both honest reducers before its
    two different means: each drops it from the round at once (that proves nothing to others:
    the grid is the round's), and still takes the mean it signed, so the reports show two means
    and the forwarded frames prove them. (Refused, no member held either mean: the part fell
    back alike, but the liar was never proven, and every round it lied again; CI's
    ``lie:push1e30+short+replay+equivocate``.)"""
    async def run():
        a, b = member(1), member(2)
        for rnd, values in ((a, ONES), (b, TWOS)):
            rnd.collecting_pushes = True
            s = 10 * rnd.me
            push = seal(PushSlice(run_id=RUN, fragment=0, round=1, group_id=GID, part=rnd.me, offset=s, numel=7,
                                  shape=(7,), dtype="float32", codec="fp32", weight=1.0, stopping=False,
                                  payload=get_codec("fp32").encode(torch.ones(7))), KEYS[0])
            deliver(rnd, push)
            assert rnd.dropped[0].startswith("PushSlice:") and "grid" in rnd.dropped[0]
            rnd.collecting_pushes = False
            deliver(rnd, mean(values))
            assert rnd.holds(0)
            for j in range(1, N):
                hold(rnd, j, torch.full((10,), 3.0 + j))
            rnd.agreeing = True
            rnd.reported = rnd.digests()
        deliver(a, report(b))
        deliver(b, report(a))
        assert a.unproven() == [0] and b.unproven() == [0]
        for rnd, other, via in ((a, b, 2), (b, a, 1)):
            for frames in other.frames[0]:
                deliver(rnd, frames[0], via=via)
        for rnd in (a, b):
            assert 0 in rnd.convicted and [o[0] for o in rnd.offences.values()] == [KEYS[0].public_key]

    asyncio.run(run())


def test_a_false_report_proves_nothing_and_the_part_is_kept():
    async def run():
        a = member(1)
        deliver(a, mean(ONES))
        for j in range(1, N):
            hold(a, j, torch.full((10,), 3.0 + j))
        a.agreeing = True
        liar = list(a.digests())
        liar[0] = b"\x01" * 32  # member 2 says it holds another mean of part 0: it has no frame to show
        deliver(a, seal(PartsHeld(run_id=RUN, fragment=0, round=1, group_id=GID, digests=tuple(liar)), KEYS[2]))
        assert a.unproven() == [0]  # we wait (up to the agreement's deadline) for proof
        # it forwards our own mean back, or a mean of another part: neither proves anything
        deliver(a, mean(ONES), via=2)
        deliver(a, mean(TWOS, part=1, offset=10, signer=KEYS[1]), via=2)
        assert a.convicted == {} and a.offences == {} and a.holds(0)

    asyncio.run(run())


def test_a_member_that_lacked_the_part_gets_both_means_forwarded_and_falls_back_without_waiting():
    async def run():
        c = member(3)  # the liar withheld part 0 from member 3, sent ONES to 1 and TWOS to 2
        for j in (1, 2):
            hold(c, j, torch.full((10,), 3.0 + j))
        hold(c, 3, torch.full((10,), 6.0))
        c.agreeing = True
        d1, d2 = list(c.digests()), list(c.digests())
        d1[0], d2[0] = b"\x01" * 32, b"\x02" * 32  # what 1 and 2 report for part 0 (any two digests)
        for i, d in ((1, d1), (2, d2)):
            deliver(c, seal(PartsHeld(run_id=RUN, fragment=0, round=1, group_id=GID, digests=tuple(d)), KEYS[i]))
        deliver(c, report(member(0)))  # the liar reports too (holding nothing, as it happens)
        assert c.wanted() == [0] and c.unproven() == [0] and not c.agreed()
        deliver(c, mean(ONES), via=1)  # 1 forwards its mean: taken
        assert c.holds(0) and c.wanted() == []
        deliver(c, mean(TWOS), via=2)  # 2 forwards its own: another mean, signed by 0
        assert 0 in c.convicted and c.wanted() == [] and c.unproven() == []
        assert c.agreed()  # nothing left to wait for

    asyncio.run(run())


def test_a_proof_the_reports_did_not_show_bans_the_reducer_and_every_member_still_lands_the_reported_mean():
    """The liar sent everyone ONES and signed TWOS for a colluder, who forwards it to member 1
    alone after the reports (all showing ONES) went out. Member 1 convicts the reducer and
    passes the proof on to the members that hold the part. Only those the proof reaches know
    of it, whenever it reaches them: each lands the part the reports showed, as the members
    it never reaches do, so they stay alike. The round is not settled (a liar with a
    colluder could have shown two members different reports): the node compares states."""
    async def run():
        a, c = member(1), member(3)
        for rnd in (a, c):
            deliver(rnd, mean(ONES))
            for j in range(1, N):
                hold(rnd, j, torch.full((10,), 3.0 + j))
            rnd.agreeing = True
            rnd.reported = rnd.digests()
        for rnd, other in ((a, c), (c, a)):
            deliver(rnd, report(other))
        for rnd in (a, c):
            deliver(rnd, report(member(0)))
            # the colluder reports what the others hold
            deliver(rnd, seal(PartsHeld(run_id=RUN, fragment=0, round=1, group_id=GID, digests=a.reported), KEYS[2]))
        assert a.unproven() == [] and a.settled()
        landed_without_proof = c.land()
        deliver(a, mean(TWOS), via=2)  # the colluder forwards the other mean, after the reports
        assert 0 in a.convicted and not a.visible(0) and a.kept(0) and not a.settled()
        assert [o[0] for o in a.offences.values()] == [KEYS[0].public_key]
        assert sorted(a.proof_wanted()) == [(2, 0), (3, 0)]  # those that reported holding part 0
        c.landed = None
        for frame in a.convicted[0]:  # what a sends as proof reaches member 3
            deliver(c, frame, via=1)
        assert 0 in c.convicted and c.kept(0) and not c.settled()
        assert [o[0] for o in c.offences.values()] == [KEYS[0].public_key]
        for rnd in (a, c):
            assert rnd.land() == landed_without_proof and rnd.landed[0] == rnd.reported[0]
        assert a.result.equal(c.result)

    asyncio.run(run())


def test_a_member_that_took_the_other_mean_takes_a_forward_of_the_reported_one_in_its_place():
    """Member 2 reported lacking part 0; the liar then sent it TWOS, and member 1's forward of
    ONES (what the reports show) came after: proof. Member 2 waits for that forward whole and
    lands ONES, as members 1 and 3 do (before, it fell back while they landed ONES)."""
    async def run():
        a, d = member(1), member(2)
        deliver(a, mean(ONES))
        for rnd in (a, d):
            for j in range(1, N):
                hold(rnd, j, torch.full((10,), 3.0 + j))
            rnd.agreeing = True
            rnd.reported = rnd.digests()
        assert d.reported[0] == b""
        for rnd, other in ((a, d), (d, a)):
            deliver(rnd, report(other))
        deliver(d, seal(PartsHeld(run_id=RUN, fragment=0, round=1, group_id=GID, digests=a.reported), KEYS[3]))
        deliver(d, report(member(0)))
        d.collecting_means = True
        deliver(d, mean(TWOS))  # late, straight from the liar
        d.collecting_means = False
        assert d.holds(0) and d.digests()[0] != a.reported[0]
        assert (2, 0) in a.forward_wanted()
        deliver(d, mean(ONES), via=1)
        assert 0 in d.convicted and not d.visible(0)
        assert d.holds(0) and d.digests()[0] == a.reported[0] and d.kept(0) and d.wanted() == []
        assert d.land().fallback == () and d.result[:10].equal(ONES)

    asyncio.run(run())


def test_a_convicted_reducers_own_report_cannot_split_the_members_that_hold_its_proof():
    """The liar's report to member 1 alone shows another digest of its part, and it sends
    member 1 a second mean: member 1 convicts it. Member 2 gets the proof from member 1
    before the liar's true-looking report. The liar's own report counts for nothing once it
    is convicted, so both see the reports show one mean and land it (before, member 1 fell
    back and member 2 kept it)."""
    async def run():
        a, b = member(1), member(2)
        for rnd in (a, b):
            deliver(rnd, mean(ONES))
            for j in range(1, N):
                hold(rnd, j, torch.full((10,), 3.0 + j))
            rnd.agreeing = True
            rnd.reported = rnd.digests()
        deliver(a, report(b))
        deliver(b, report(a))
        for rnd in (a, b):
            deliver(rnd, seal(PartsHeld(run_id=RUN, fragment=0, round=1, group_id=GID, digests=a.reported), KEYS[3]))
        lie = list(a.reported)
        lie[0] = b"\x01" * 32
        deliver(a, seal(PartsHeld(run_id=RUN, fragment=0, round=1, group_id=GID, digests=tuple(lie)), KEYS[0]))
        assert a.unproven() == [0] and not a.agreed()
        deliver(a, mean(TWOS))  # the second mean, to member 1
        assert 0 in a.convicted and a.agreed() and not a.visible(0) and a.kept(0)
        for frame in a.convicted[0]:
            deliver(b, frame, via=1)
        deliver(b, report(member(0)))
        assert 0 in b.convicted and b.kept(0)
        assert a.land().fallback == () == b.land().fallback and a.result.equal(b.result)

    asyncio.run(run())
