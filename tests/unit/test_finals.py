"""Finals (peer.allreduce_round, step 5): a member that started so late that the others landed
before its part existed falls back on that part as they did, and a member's final cannot
make another fall back on a part that came on time. No network: frames go from the test to
a Round by hand."""

import asyncio
from collections import OrderedDict
from types import SimpleNamespace

import torch

from peer import inbox
from peer.allreduce import Group
from peer.inbox import keep_recent
from peer.allreduce_round import Round
from peer.allreduce_wait import WaitMixin
from peer.quiet import FINISHED_DROP
from protocol.codecs import get_codec
from protocol.envelope import seal, verify
from protocol.evidence import proves
from protocol.identity import Identity
from protocol.messages import digest
from protocol.messages_swarm import PartsHeld, SliceAveraged

RUN = b"\x07" * 20
GID = b"f" * 16
N = 3
KEYS = [Identity.from_seed(bytes([0x40 + i]) * 32) for i in range(4)]  # the first n are a group of n
LATE = 2  # the member that started late, and reducer of part 2


def member(me: int, banned: frozenset = frozenset(), n: int = N) -> Round:
    group = Group(run_id=RUN, fragment=0, round=1, group_id=GID, members=tuple(k.public_key for k in KEYS[:n]),
                  weights=(1.0,) * n, numel=10 * n, codec="fp32", deadline_s=5.0)
    rnd = Round(group, me, torch.zeros(10 * n), get_codec("fp32"), banned=banned)
    rnd.collecting_pushes = False
    return rnd


def deliver(rnd: Round, frame: bytes) -> None:
    v = verify(frame)
    rnd.accept(v.peer_id, v, len(frame), frame)


def hold(rnd: Round, j: int, contributors: tuple[int, ...]) -> None:
    """``rnd`` holds part j, reduced over ``contributors``: its own, or its reducer's frame."""
    values = torch.full((10,), 1.0 + j)
    payload = get_codec("fp32").encode(values)
    frame = seal(SliceAveraged(run_id=RUN, fragment=0, round=1, group_id=GID, part=j, offset=10 * j, numel=10,
                               shape=(10,), dtype="float32", codec="fp32", weight=float(len(contributors)),
                               contributors=contributors, inputs=b"i" * 32, own=digest(payload), payload=payload), KEYS[j])
    if j == rnd.me:
        rnd.own([(10 * j, 10 * j + 10, payload)], [])  # its own slice as it averaged it: here, its mean's bytes
        rnd.reduced(contributors, [(10 * j, 10 * j + 10, payload)], [[frame]])
    else:
        deliver(rnd, frame)


def final(i: int, digests: tuple[bytes, ...], is_final: bool = True) -> bytes:
    return seal(PartsHeld(run_id=RUN, fragment=0, round=1, group_id=GID, digests=digests, final=is_final), KEYS[i])


def landed_without(rnd: Round, j: int) -> tuple[bytes, ...]:
    return tuple(b"" if k == j else d for k, d in enumerate(rnd.digests()))


def late_member(on_time: bool) -> Round:
    """Member 2 holds every part; the others reduced theirs without its slice (it came too
    late to them) unless ``on_time``."""
    rnd = member(LATE)
    others = (0, 1, 2) if on_time else (0, 1)
    for j in (0, 1):
        hold(rnd, j, others)
    hold(rnd, LATE, (0, 1, 2))
    return rnd


def test_a_late_reducer_falls_back_on_its_part_as_the_members_that_finished_before_it_did():
    rnd = late_member(on_time=False)
    assert rnd.came_late(LATE) and rnd.conform() == []  # nobody has finished: nothing to follow
    for i in (0, 1):
        deliver(rnd, final(i, landed_without(rnd, LATE)))
    assert rnd.conform() == [LATE]
    # and it does not wait for reports from members that have finished
    assert rnd.took_part() == [] and rnd.wanted() == []


def test_a_final_cannot_make_a_member_fall_back_on_a_part_that_came_on_time():
    rnd = late_member(on_time=True)
    for i in (0, 1):
        deliver(rnd, final(i, landed_without(rnd, LATE)))
    assert not rnd.came_late(LATE) and rnd.conform() == []
    # nor on another member's part that reached it in time
    assert rnd.conform() == [] and not rnd.came_late(0)


def test_a_late_part_is_kept_when_as_many_finished_members_landed_it_as_did_not():
    rnd = late_member(on_time=False)
    deliver(rnd, final(0, landed_without(rnd, LATE)))
    deliver(rnd, final(1, rnd.digests()))  # it landed our mean of part 2
    assert rnd.conform() == []
    # a final with another mean of the part counts for neither side
    rnd = late_member(on_time=False)
    deliver(rnd, final(0, landed_without(rnd, LATE)))
    deliver(rnd, final(1, tuple(b"x" * 32 if k == LATE else d for k, d in enumerate(rnd.digests()))))
    assert rnd.conform() == [LATE]


def test_a_banned_members_final_is_not_followed():
    rnd = late_member(on_time=False)
    rnd.banned = frozenset({KEYS[0].peer_id})
    deliver(rnd, final(0, landed_without(rnd, LATE)))
    assert rnd.conform() == []
    deliver(rnd, final(1, landed_without(rnd, LATE)))
    assert rnd.conform() == [LATE]
    # nor is the final of a member dropped from the round for a frame that failed a check
    rnd.drop(1, "PushSlice:values must be finite")
    assert rnd.conform() == []


def test_another_reducers_part_is_followed_only_when_it_was_late_to_us():
    rnd = member(0)
    hold(rnd, 0, (0, 1, 2))
    hold(rnd, 1, (0, 1, 2))
    hold(rnd, 2, (0, 1, 2))
    deliver(rnd, final(1, landed_without(rnd, 2)))
    assert rnd.conform() == []  # part 2 came in time: member 1's word alone changes nothing
    rnd.drop(2, "timeout:slice not received in time")
    assert rnd.conform() == [2]


def test_a_liars_final_cannot_make_us_fall_back_while_a_member_that_waited_for_our_part_has_not_finished():
    """Member 0 (a liar that leads the group) cut us from its part, so the only other part we
    hold lacks our slice and our own part looks late (member 1's part is on its way, or
    member 1 reduces none); its final then says it landed without our part. Member 1, which
    pushed to us and waits for our part, lands it: we must too. Only the finals of most of
    the members that waited for the part (its contributors) make us fall back."""
    for ours in ((1, LATE), (0, 1, LATE)):  # the liar's slice cut from our part too, or counted
        rnd = member(LATE)
        hold(rnd, 0, (0,))
        hold(rnd, LATE, ours)
        assert rnd.came_late(LATE)
        deliver(rnd, final(0, landed_without(rnd, LATE)))
        assert rnd.conform() == [], ours
        deliver(rnd, final(1, landed_without(rnd, LATE)))  # the member that waited for it landed without it
        assert rnd.conform() == [LATE], ours


def test_members_judging_one_late_part_follow_the_same_finals():
    """Member 0 finished without part 2 (its starved reducer's). Member 1 dropped reducer 2
    as late, reported lacking its part, then got it; reducer 2's own part looks late to it.
    Both must follow member 0's final: member 1's report says it got the part late, so it
    counts for neither side (counted as landing the part, it kept reducer 2 from following
    while member 1 followed: a review's repro)."""
    late, other = member(LATE), member(1)
    for rnd in (late, other):
        hold(rnd, 0, (0, 1))
        hold(rnd, 1, (0, 1))
    other.drop(LATE, "timeout:reduced part not received in time")
    for rnd in (late, other):
        hold(rnd, LATE, (0, 1, 2))
    assert late.digests() == other.digests()
    for rnd in (late, other):
        deliver(rnd, final(0, landed_without(rnd, LATE)))
    deliver(late, final(1, landed_without(other, LATE), is_final=False))  # member 1's report
    assert late.conform() == other.conform() == [LATE]


def test_a_reducer_nobody_reached_in_time_follows_the_finals():
    """Every push to a starved reducer timed out: its part has no contributor but itself. The
    others' finals still count (a rule counting only the part's contributors left it landing
    its own values where everyone else fell back)."""
    for n in (2, 3):
        rnd = member(n - 1, n=n)
        others = tuple(range(n - 1))
        for j in others:
            hold(rnd, j, others)
        hold(rnd, n - 1, (n - 1,))
        for i in others:
            deliver(rnd, final(i, landed_without(rnd, n - 1)))
        assert rnd.conform() == [n - 1], n


def test_a_lying_reducer_cannot_choose_who_counts_for_each_member():
    """Of four, member 0 reduced part 0 and sent it late to members 1 and 2 (both dropped it as
    late), naming member 2 no contributor; member 3 finished without it. Members 1 and 2 have
    reported lacking the part: they follow member 3's final alike."""
    rounds = [member(me, n=4) for me in (1, 2)]
    for rnd in rounds:
        for j in (1, 2, 3):
            hold(rnd, j, (0, 1, 2, 3))
        rnd.drop(0, "timeout:reduced part not received in time")
        hold(rnd, 0, (0, 1, 3))
    without = landed_without(rounds[0], 0)
    for rnd in rounds:
        deliver(rnd, final(3, without))
        deliver(rnd, final(1 if rnd.me == 2 else 2, without, is_final=False))
    assert [rnd.conform() for rnd in rounds] == [[0], [0]]


def test_a_liars_final_cannot_outvote_the_reducer_that_landed_its_part():
    """Part 2 reached member 1 late; its reducer landed it (its final says so), the liar's final
    says it landed without it: one against one, member 1 keeps the part."""
    rnd = member(1)
    for j in (0, 1):
        hold(rnd, j, (0, 1, 2))
    rnd.drop(2, "timeout:reduced part not received in time")
    hold(rnd, 2, (0, 1, 2))
    deliver(rnd, final(2, rnd.digests()))
    deliver(rnd, final(0, landed_without(rnd, 2)))
    assert rnd.conform() == []


def test_a_member_counts_itself_as_the_others_count_it():
    """Of four, reducer 3 came late to every member (all dropped it at their push deadline);
    member 1's report held its part, member 2's lacked it; the liar 0 says it landed without
    it. Member 1 counts its own report as the others count it: it lands the part, as reducer 3
    and member 2 do (leaving itself out, it fell back alone: a review's repro)."""
    rounds = {}
    for me in (1, 2, 3):
        rnd = member(me, n=4)
        for j in (0, 1, 2):
            hold(rnd, j, (0, 1, 2))
        if me != 3:
            rnd.drop(3, "timeout:slice not received in time")
        hold(rnd, 3, (0, 1, 2, 3))
        rounds[me] = rnd
    full = rounds[3].digests()
    reported = {1: full, 2: landed_without(rounds[2], 3), 3: full}
    for me, rnd in rounds.items():
        rnd.reported = reported[me]
        deliver(rnd, final(0, landed_without(rnd, 3)))
        for other in (1, 2, 3):
            if other != me:
                deliver(rnd, final(other, reported[other], is_final=False))
    assert all(rnd.came_late(3) for rnd in rounds.values())
    assert [rounds[me].conform() for me in (1, 2, 3)] == [[], [], []]


def test_a_contributor_our_report_could_not_reach_does_not_hold_us_back():
    """Member 1 pushed to us, then left (our report could not reach it); member 0 finished
    without our late part: we follow member 0."""
    rnd = late_member(on_time=False)
    deliver(rnd, final(0, landed_without(rnd, LATE)))
    assert rnd.conform() == []  # member 1 may still land it
    rnd.gone.add(1)
    assert rnd.conform() == [LATE]


def test_a_final_is_kept_apart_from_the_report_and_once_per_member():
    rnd = late_member(on_time=False)
    first = landed_without(rnd, LATE)
    deliver(rnd, final(0, first))
    deliver(rnd, final(0, first))  # a resend
    assert rnd.finals == {0: first} and rnd.reports == {} and not rnd.final_proofs
    rnd.landed = rnd.digests()
    assert rnd.apart() == [0]
    rnd.landed = first
    assert rnd.apart() == []
    deliver(rnd, final(0, rnd.digests()))  # a second final naming other parts: the first stays, and the
    assert rnd.finals == {0: first}  # pair proves that member 0 told members different things
    assert [(j, proves(proof, RUN)[0]) for j, _, proof in rnd.final_proofs] == [(0, KEYS[0].public_key)]
    rnd.landed = rnd.digests()
    assert rnd.apart() == []  # a proven liar's final says nothing about us



def test_one_members_report_cannot_make_a_reducer_on_its_way_look_late():
    """A part we lack counts as held elsewhere (we stop waiting for it after a grace, and its
    reducer counts as late) only once two members other than its reducer reported it held
    with one digest. A liar's early report of made-up digests alone would make an honest
    reducer on its way late, and its final would then make us fall back on the part when it
    comes, while members it reached in time land it."""
    n, liar = 4, 3
    keys = [Identity.from_seed(bytes([0x50 + i]) * 32) for i in range(n)]
    group = Group(run_id=RUN, fragment=0, round=1, group_id=GID, members=tuple(k.public_key for k in keys),
                  weights=(1.0,) * n, numel=10 * n, codec="fp32", deadline_s=5.0)

    def told(rnd: Round, i: int, digests: tuple[bytes, ...], final: bool = False) -> None:
        deliver(rnd, seal(PartsHeld(run_id=RUN, fragment=0, round=1, group_id=GID, digests=digests, final=final),
                          keys[i]))

    def mean(j: int) -> bytes:
        payload = get_codec("fp32").encode(torch.full((10,), 1.0 + j))
        return seal(SliceAveraged(run_id=RUN, fragment=0, round=1, group_id=GID, part=j, offset=10 * j, numel=10,
                                  shape=(10,), dtype="float32", codec="fp32", weight=float(n),
                                  contributors=tuple(range(n)), inputs=b"i" * 32, own=digest(payload),
                                  payload=payload), keys[j])

    rnd = Round(group, 0, torch.zeros(10 * n), get_codec("fp32"))
    rnd.collecting_pushes = False
    told(rnd, liar, (b"\x99" * 32,) * n)  # every part held, before any mean is out
    for j in (1, 3):
        deliver(rnd, mean(j))
    assert rnd.held_elsewhere_at(0.5) == float("inf")  # part 2: we keep waiting, its reducer is not late
    deliver(rnd, mean(2))
    assert rnd.means_done() and not rnd.dropped and not rnd.came_late(2)
    told(rnd, liar, (b"",) * n, final=True)  # "I landed none of them"
    assert rnd.conform() == []

    other = Round(group, 0, torch.zeros(10 * n), get_codec("fp32"))
    told(other, liar, (b"", b"", b"\x99" * 32, b""))
    told(other, 1, (b"", b"", b"\x22" * 32, b""))  # two members, two digests: neither is corroborated
    assert 2 not in other.held_since
    honest = Round(group, 0, torch.zeros(10 * n), get_codec("fp32"))
    for i in (1, 2):  # part 3 held alike by two members: its reducer sent it to them, not (yet) to us
        told(honest, i, (b"", b"", b"", b"\x33" * 32))
    assert 3 in honest.held_since


WINDOW = 2 * 2.5 * 5.0  # two agreement windows of a 5 s deadline


def _finished(at: float, nbytes: int = 1000) -> SimpleNamespace:
    """A finished round as ``keep_recent`` sees it: until when it is kept, its frames."""
    return SimpleNamespace(keep_until=at + WINDOW, frames={0: [[b"h", b"x" * (nbytes - 1)]]}, own_frames=[],
                           push_frames={2: [(0, 5, b"d", b"y" * 10)]})


def test_finished_rounds_are_kept_for_a_late_members_report_by_time_not_by_count(monkeypatch):
    """A member that waited in a group nobody joined reports for its next round up to an
    agreement window (2.5 D) after the others finished it; a swarm of small fragments finishes
    many rounds meanwhile. The rounds finished within two windows are kept to answer it (CI: a
    starved member came 9 s late, four rounds later, got no answer and landed apart), the
    newest four whatever their age, and no more than ``RECENT_BYTES`` of frames."""
    recent = OrderedDict((bytes([i]), _finished(at=i / 2)) for i in range(40))  # two rounds a second
    keep_recent(recent, now=20.0)
    assert len(recent) == 40  # all within 25 s
    keep_recent(recent, now=2.0 + WINDOW + 0.25)  # rounds 0-4 finished more than a window ago
    assert list(recent) == [bytes([i]) for i in range(5, 40)]
    keep_recent(recent, now=1000.0)  # long ago: the newest four are still kept
    assert list(recent) == [bytes([i]) for i in range(36, 40)]
    monkeypatch.setattr(inbox, "RECENT_BYTES", 10_100)
    recent = OrderedDict((bytes([i]), _finished(at=i / 2)) for i in range(40))
    keep_recent(recent, now=20.0)
    assert list(recent) == [bytes([i]) for i in range(30, 40)]  # 10 rounds of 1010 bytes


def test_a_member_that_came_after_the_others_finished_does_not_wait_for_parts_they_will_not_send():
    """CI: member 2 came to a round after 0 and 1 had landed it without its slice: their parts
    never come to it (not a contributor), and it waited the means' deadline for them, then
    reported after they had left the run. Reducers whose finals are in have finished: their
    parts come, if at all, forwarded in answer to our report, which we send at once."""
    rnd = member(LATE)
    hold(rnd, LATE, (0, 1, 2))  # its own part, of the others' pushes that waited for it
    parts = {j: b"d" * 32 for j in (0, 1)}
    deliver(rnd, final(0, (parts[0], parts[1], b"")))
    assert not rnd.lacking_finished()  # part 1's reducer may still send it
    deliver(rnd, final(1, (parts[0], parts[1], b"")))
    assert rnd.lacking_finished()

    async def wait() -> None:
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(WaitMixin._wait_means(None, rnd, loop.time() + 60.0), 10.0)  # not the deadline

    asyncio.run(wait())
    assert rnd.wanted() == [0, 1]  # asked for in our report
    rnd.drop(0, FINISHED_DROP)  # late, not lying: its part is still taken, and its final counts
    assert rnd.came_late(0) and rnd._believed(0)


def _mean_frames(j: int, value: float, contributors: tuple[int, ...], weight: float = 0.0) -> list[bytes]:
    payload = get_codec("fp32").encode(torch.full((10,), value))
    return [seal(SliceAveraged(run_id=RUN, fragment=0, round=1, group_id=GID, part=j, offset=10 * j, numel=10,
                               shape=(10,), dtype="float32", codec="fp32", weight=weight or float(len(contributors)),
                               contributors=contributors, inputs=b"i" * 32, own=digest(payload), payload=payload),
                 KEYS[j])]


def test_a_part_that_comes_whole_from_its_reducer_after_the_reports_is_forwarded_to_those_that_lacked_it():
    """Reducer 0 sent its final early (both others stopped waiting for its part and reported
    lacking it), then its part to member 1 only. Member 1 forwards it to member 2 as soon as it
    is whole: it used to forward only on a report or a forwarded frame, so it landed the part
    while member 2 waited to its deadline and fell back (a review's repro, through the handler)."""
    from peer.allreduce import Averager

    rnd = member(1)
    for j in (1, 2):
        hold(rnd, j, (1, 2))
    av = Averager(p2p=None, identity=KEYS[1], run_id=RUN)
    av._active[GID] = rnd
    forwards: list[int] = []

    async def deliver_to(rnd_, j, frames, deadline, sent, drop):
        forwards.append(j)
        return True

    av._deliver = deliver_to

    async def agreement() -> None:
        rnd.agree_deadline = asyncio.get_running_loop().time() + 12.5
        rnd.drop(0, FINISHED_DROP)
        rnd.agreeing, rnd.reported = True, rnd.digests()
        av._on_frame(KEYS[2].peer_id, final(2, rnd.reported, is_final=False))  # member 2 lacks part 0 too
        assert forwards == [] and not rnd.holds(0)
        for frame in _mean_frames(0, 9.0, (0, 1)):
            av._on_frame(KEYS[0].peer_id, frame)  # a late member's part: taken after our report
        await asyncio.sleep(0)
        assert rnd.holds(0) and forwards == [2]

    asyncio.run(agreement())


def test_a_liars_part_completed_after_our_report_is_not_taken():
    """A reducer dropped for a lie (its push was off the grid) has its part taken until we
    report: then its means show in the reports. After our report it is not taken: completed
    for us alone then, we landed it while a member that had reported lacking it fell back (a
    review's repro). A late member's part is still taken then."""
    for reason, taken in (("PushSlice:chunk off the run's grid", False), ("timeout:slice not in by the deadline", True)):
        rnd = member(1)
        rnd.drop(0, reason)
        rnd.agreeing, rnd.reported = True, rnd.digests()
        for frame in _mean_frames(0, 9.0, (0, 1)):
            deliver(rnd, frame)
        assert rnd.holds(0) is taken, reason
        assert rnd.came_late(0)  # either way, its part follows the finals of the members that finished first


def test_a_member_late_at_will_that_then_lies_loses_a_late_members_say():
    """A liar can have itself dropped as late with one frame (an early final); a frame of its
    that then fails a check makes it a liar in our round: its final no longer counts."""
    rnd = member(1)
    rnd.drop(0, FINISHED_DROP)
    assert rnd._believed(0)
    bad = _mean_frames(0, 9.0, (0, 1), weight=7.0)[0]  # not its contributors' total
    deliver(rnd, bad)
    assert not rnd._believed(0) and not rnd.dropped[0].startswith("timeout")
    rnd.drop(0, "timeout:again")  # lateness never turns a liar back into a late member
    assert not rnd.dropped[0].startswith("timeout")


def test_two_means_of_the_same_elements_sent_to_one_member_prove_equivocation():
    """Two different means of one chunk from its reducer, both to us: proof, kept (the second
    was ignored, or refused as an overlap of a part not yet whole, and the first kept: no
    proof, and the part landed)."""
    rnd = member(1)
    deliver(rnd, _mean_frames(0, 9.0, (0, 1))[0])
    deliver(rnd, _mean_frames(0, 8.0, (0, 1))[0])
    assert 0 in rnd.convicted and [o[0] for o in rnd.offences.values()] == [KEYS[0].public_key]
