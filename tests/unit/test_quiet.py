"""Which members of a finished round are marked quiet (peer.quiet), what clears a mark, what
marks nobody, and when the push phase stops waiting for a quiet member (Round)."""

import asyncio
from types import SimpleNamespace

import torch

from peer.allreduce import Group
from peer.allreduce_round import Round
from peer.quiet import CLEAR_AFTER, DEADLINE_DROP, MAX_HALVINGS, MEANS_DROP, QUIET_GRACE, QuietMembers, grace
from protocol.codecs import get_codec
from protocol.envelope import seal, verify
from protocol.identity import Identity
from protocol.messages_swarm import PushSlice

N = 4
GID = b"g" * 16


def finished_round(heard=(1, 2, 3), cut=(), banned=(), gid=GID, ids=None, reported=(), unreachable=(), hushed=(),
                   timed_out=False, waived=(), lacking=(), acked=None, n=N):
    """A finished round of four members as ``QuietMembers.judge`` reads it (we are member 0):
    ``heard`` pushed to us and reported, unless ``hushed`` (then they only pushed: the agreement
    ran to its deadline if ``timed_out``, or stopped waiting for the ``waived`` ones), ``reported``
    only reported; the others were dropped at the push deadline, or at once as ``unreachable``.
    ``acked``: the members that acknowledged our frames (by default those we heard)."""
    dropped = {i: "unreachable:gone" if i in unreachable else DEADLINE_DROP
               for i in range(1, n) if i not in heard and i not in cut}
    dropped.update({i: "timeout:slice not received, quiet" for i in cut})
    reports = {i: () for i in (*heard, *reported) if i not in hushed}
    return SimpleNamespace(n=n, me=0, peer_ids=ids or [f"peer{i}" for i in range(n)], heard=set(heard) | set(reported),
                           pushers=set(heard), cut=set(cut), dropped=dropped, banned=set(banned),
                           excluded=frozenset(), group=SimpleNamespace(group_id=gid), reports=reports, finals={},
                           gone=set(), waived=set(waived), agree_timed_out=timed_out,
                           acked=set(heard) | set(reported) if acked is None else set(acked),
                           size=lambda j: 256, holds=lambda j: j not in lacking)


def test_a_member_silent_through_a_round_is_marked_and_rounds_it_is_heard_in_clear_it():
    quiet = QuietMembers()
    assert quiet.judge(finished_round(heard=(1, 2))) == [3]
    assert "peer3" in quiet and "peer1" not in quiet
    assert quiet.of([f"peer{i}" for i in range(N)], 0) == frozenset({3})
    for _ in range(CLEAR_AFTER - 1):
        assert quiet.judge(finished_round()) == [] and "peer3" in quiet
    assert quiet.judge(finished_round(heard=(1, 2))) == [3]  # silent again: it starts over
    assert quiet.judge(finished_round(heard=(1, 2), reported=(3,))) == [3]  # a report is no push
    for _ in range(CLEAR_AFTER):
        quiet.judge(finished_round())
    assert "peer3" not in quiet


def test_a_cut_member_keeps_its_mark_and_a_late_frame_of_that_round_counts_as_heard():
    quiet = QuietMembers()
    quiet.judge(finished_round(heard=(1, 2)))
    for k in range(CLEAR_AFTER):
        gid = bytes([k]) * 16
        assert quiet.judge(finished_round(heard=(1, 2), cut=(3,), gid=gid)) == []  # cut: neither marked again
        assert "peer3" in quiet  # nor cleared
        quiet.late(gid, "peer1")  # another member's late frame says nothing about it
        quiet.late(gid, "peer3")  # its own, after we finished: it was late, not gone
        quiet.late(gid, "peer3")  # counted once per round
    assert "peer3" not in quiet


def test_a_round_we_heard_nobody_in_marks_nobody_and_banned_members_are_left_to_the_bans():
    quiet = QuietMembers()
    assert quiet.judge(finished_round(heard=())) == [] and len(quiet) == 0  # our own outage, or we are early
    assert quiet.judge(finished_round(heard=(1, 2), banned={"peer3"})) == []
    assert quiet.judge(finished_round(heard=(1, 2), unreachable=(3,))) == []  # not waited for: says nothing


def test_in_a_group_of_two_a_partner_that_took_our_frames_and_sent_nothing_is_marked():
    """We hear nobody in a pair with a ghost, every round: without a mark it held each of them
    to 2.5 D (push, means and agreement deadlines). A partner that acknowledged our frames is
    there and reading; one that did not may be our own outage, and is not marked."""
    quiet = QuietMembers()
    assert quiet.judge(finished_round(heard=(), n=2)) == [] and len(quiet) == 0  # nothing went through
    assert quiet.judge(finished_round(heard=(), n=2, acked=(1,))) == [1] and "peer1" in quiet
    hush = QuietMembers()  # it pushed, then sent no report while we waited the agreement's deadline
    assert hush.judge(finished_round(heard=(1,), hushed=(1,), timed_out=True, n=2, acked=())) == []
    assert hush.judge(finished_round(heard=(1,), hushed=(1,), timed_out=True, n=2)) == [1]


def test_marks_are_bounded_and_the_grace_grows_with_the_others_time():
    quiet = QuietMembers(capacity=2)
    for k in range(5):
        quiet.judge(finished_round(heard=(1, 2), ids=[f"a{k}", f"b{k}", f"c{k}", f"ghost{k}"]))
    assert len(quiet) == 2 and "ghost4" in quiet and "ghost0" not in quiet
    assert grace(20.0, 0.3) == QUIET_GRACE * 20.0 and grace(20.0, 7.0) == 7.0


def test_the_grace_halves_for_each_round_in_a_row_a_member_was_cut_unheard_and_is_whole_once_it_is_heard():
    """A ghost cut round after round cost every sync the whole grace (2 s at D = 20 s); a member
    heard again (a push after the cut, in the round or after it) has the whole grace again."""
    ids = [f"peer{i}" for i in range(N)]
    quiet = QuietMembers()
    assert quiet.share(ids, 0) == 1.0  # nobody quiet
    quiet.judge(finished_round(heard=(1, 2)))  # marked at the deadline
    assert quiet.share(ids, 0) == 1.0
    for k in range(MAX_HALVINGS + 2):
        quiet.judge(finished_round(heard=(1, 2), cut=(3,), gid=bytes([k]) * 16))
        assert quiet.share(ids, 0) == 0.5 ** min(k + 1, MAX_HALVINGS)
    assert quiet.share(ids, 3) == 1.0 and quiet.share(ids[:3], 0) == 1.0  # not for a group without it
    quiet.late(bytes([0]) * 16, "peer3")  # its push of a round we cut it from came after all
    assert quiet.share(ids, 0) == 1.0 and "peer3" in quiet
    quiet.judge(finished_round(heard=(1, 2), cut=(3,), gid=b"x" * 16))
    assert quiet.share(ids, 0) == 0.5
    quiet.judge(finished_round(heard=(1,), cut=(3,), gid=b"y" * 16))  # peer2 silent at the deadline:
    assert quiet.share(ids, 0) == 1.0  # a member quiet for one round gets the whole grace, the most of any
    assert quiet.share([ids[0], ids[1], ids[3]], 0) == 0.25  # (in a group without it, the ghost's own)
    assert grace(20.0, 0.1, 0.125) == QUIET_GRACE * 20.0 * 0.125 and grace(20.0, 0.3, 0.125) == 0.3


def test_the_push_phase_stops_waiting_only_for_quiet_members_not_heard_from_once_another_pushed():
    keys = [Identity.from_seed(bytes([i + 1]) * 32).public_key for i in range(N)]
    group = Group(run_id=b"r" * 20, fragment=0, round=1, group_id=GID, members=tuple(keys), weights=(1.0,) * N,
                  numel=1024, codec="fp32", deadline_s=10.0)
    rnd = Round(group, 0, torch.zeros(1024), get_codec("fp32"))
    size = rnd.size(0)
    assert not rnd.pushes_done_but_quiet()  # nobody is quiet
    rnd.quiet = frozenset({3})
    assert not rnd.pushes_done_but_quiet()  # nobody else pushed yet: we may be early
    rnd.pushed[1] = size
    assert not rnd.pushes_done_but_quiet()  # member 2, not quiet, is still to come
    rnd.pushed[2] = size
    assert rnd.pushes_done_but_quiet() and rnd.silent_quiet() == [3]
    rnd.heard.add(3)  # a report alone: still silent (one tiny frame per round must not cost the deadline)
    assert rnd.pushes_done_but_quiet()
    rnd.pushers.add(3)  # a push of its, to us: the full wait again
    assert not rnd.pushes_done_but_quiet() and rnd.silent_quiet() == []


def test_a_member_that_pushed_and_never_reported_through_the_agreement_is_marked_and_only_a_whole_round_clears_it():
    """``lie:hush``: it pushes, then sends no part and no report. Marked when we waited the
    agreement's whole deadline for its report and another member reported; a round in which it
    pushes but does not report does not count towards clearing; a round we stopped waiting for
    it (``waived``) leaves the mark as it is."""
    quiet = QuietMembers()
    assert quiet.judge(finished_round(hushed=(3,))) == [] and len(quiet) == 0  # we did not wait to the deadline
    assert quiet.judge(finished_round(hushed=(1, 2, 3), timed_out=True)) == []  # nobody else reported
    assert quiet.judge(finished_round(hushed=(3,), timed_out=True)) == [3] and "peer3" in quiet
    for _ in range(CLEAR_AFTER):
        assert quiet.judge(finished_round(hushed=(3,), waived=(3,))) == [] and "peer3" in quiet
        assert quiet.judge(finished_round(hushed=(3,))) == [] and "peer3" in quiet  # a push alone
    for _ in range(CLEAR_AFTER):
        quiet.judge(finished_round())
    assert "peer3" not in quiet


def test_the_means_and_the_agreement_stop_waiting_only_for_quiet_members_once_everyone_else_is_in():
    keys = [Identity.from_seed(bytes([i + 1]) * 32).public_key for i in range(N)]
    group = Group(run_id=b"r" * 20, fragment=0, round=1, group_id=GID, members=tuple(keys), weights=(1.0,) * N,
                  numel=1024, codec="fp32", deadline_s=10.0)
    rnd = Round(group, 0, torch.zeros(1024), get_codec("fp32"))
    rnd.quiet = frozenset({3})
    for i in (1, 2, 3):
        rnd.pushed[i] = rnd.size(0)
    assert rnd.means_done_but_quiet() == []  # no other reducer's part yet
    for j in (1, 2):  # as a part held: its contributors and chunks (peer.round_intake)
        rnd.contributors[j], rnd.mean_chunks[j] = (0, 1, 2, 3), []
    rnd.got[1], rnd.frames[1] = rnd.size(1), []
    assert rnd.means_done_but_quiet() == []  # part 2, of a member not quiet, is still to come
    rnd.got[2], rnd.frames[2] = rnd.size(2), []
    assert rnd.means_done_but_quiet() == [3]
    rnd.reports[1] = rnd.digests()
    assert not rnd.agreed_but_quiet()  # member 2's report, not quiet, is still to come
    rnd.reports[2] = rnd.digests()
    assert rnd.agreed_but_quiet() and not rnd.agreed()  # only the quiet member's report is missing
    rnd.quiet = frozenset()
    assert not rnd.agreed_but_quiet() and rnd.means_done_but_quiet() == []  # not quiet: the full wait


def test_a_member_that_sent_a_frame_that_failed_a_check_is_marked_and_such_a_round_never_clears_it():
    """One bad frame per round (a chunk off its slice: no proof, no ban) would otherwise keep a
    ghost's mark from ever being set, or clear it, and its slice would fall back every round."""
    quiet = QuietMembers()
    bad = finished_round()
    bad.dropped[3] = "PushSlice:chunk [0, 256) is not on slice [768, 1024)"
    assert quiet.judge(bad) == [3] and "peer3" in quiet
    for _ in range(CLEAR_AFTER):
        quiet.judge(bad)  # it pushed and reported, and sent a bad frame: not a round heard
    assert "peer3" in quiet
    late = finished_round()
    late.dropped[3] = "short:its stream ended after 10 of the slice's 256 elements"  # late, not refused
    assert QuietMembers().judge(late) == []


def test_an_idle_member_waits_for_the_report_of_a_member_no_reducer_counted_as_the_reducers_do():
    """An idle member (``GroupFormed.idle``) gets no pushes, so it drops nobody as late; a member
    that no part it holds counted and that did not report is late to it, as to the reducers:
    the round is not settled (states are compared after it) on every member alike."""
    keys = [Identity.from_seed(bytes([i + 1]) * 32).public_key for i in range(6)]
    group = Group(run_id=b"r" * 20, fragment=0, round=1, group_id=GID, members=tuple(keys), weights=(1.0,) * 6,
                  numel=1024, codec="fp32", deadline_s=10.0, idle=(4, 5))
    rnd = Round(group, 4, torch.zeros(1024), get_codec("fp32"))
    assert rnd.size(4) == rnd.size(5) == 0
    for j in range(4):  # every part held, each counting every member but 5 (a ghost)
        rnd.contributors[j], rnd.mean_chunks[j] = (0, 1, 2, 3, 4), []
        rnd.got[j], rnd.frames[j] = rnd.size(j), []
    for i in range(4):
        rnd.reports[i] = rnd.digests()
    assert rnd.agreed() and not rnd.settled()  # member 5: counted by nobody, no report
    rnd.reports[5] = rnd.digests()
    assert rnd.settled()


def test_a_reducer_whose_part_never_came_while_another_did_is_marked_and_a_round_without_its_part_never_clears_it():
    """A member that pushes and reports but never sends its reduced part (or claims to hold it
    and never forwards it) held the means to their deadline every round: it is marked when we
    waited that whole deadline for its part and got another reducer's; a round in which its
    part did not come does not count towards clearing."""
    quiet = QuietMembers()
    r = finished_round(lacking=(3,))
    r.dropped[3] = MEANS_DROP
    assert quiet.judge(r) == [3] and "peer3" in quiet
    for _ in range(CLEAR_AFTER):
        assert quiet.judge(finished_round(lacking=(3,))) == [] and "peer3" in quiet  # pushed and reported, no part
    for _ in range(CLEAR_AFTER):
        quiet.judge(finished_round())
    assert "peer3" not in quiet
    alone = finished_round(lacking=(1, 2, 3))  # no other part came either: our own trouble, maybe
    alone.dropped[3] = MEANS_DROP
    assert QuietMembers().judge(alone) == []


def _late_round(chunk=None):
    """A real round of four (we are member 0) past its push deadline, member 3 dropped there;
    slices sent in chunks of ``chunk`` elements (default: one chunk each)."""
    keys = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(N)]
    group = Group(run_id=b"r" * 20, fragment=0, round=1, group_id=GID, members=tuple(k.public_key for k in keys),
                  weights=(1.0,) * N, numel=1024, codec="fp32", deadline_s=10.0)
    rnd = Round(group, 0, torch.zeros(1024), get_codec("fp32"), **({} if chunk is None else {"chunk": chunk}))
    rnd.collecting_pushes = False
    rnd.drop(3, DEADLINE_DROP)
    return rnd, keys


def _late_push(rnd, keys, sender, *, part=0, weight=1.0, values=None, codec="fp32", span=None):
    s, e = rnd.bounds[part] if span is None else span
    values = torch.ones(e - s) if values is None else values
    payload = values.numpy().tobytes() if codec == "fp32" else get_codec(codec).encode(values)  # NaN too (a liar's)
    g = rnd.group
    frame = seal(PushSlice(run_id=g.run_id, fragment=g.fragment, round=g.round, group_id=g.group_id, part=part,
                           offset=s, numel=e - s, shape=(e - s,), dtype="float32", codec=codec, weight=weight,
                           stopping=False, payload=payload), keys[sender])
    return verify(frame), frame


def test_only_a_late_push_that_would_have_passed_the_checks_shows_a_member_was_late_not_gone():
    """A late push counts as a sign of life (``Round.pushers``; after the round, it clears a cut
    member's round, ``QuietMembers.late``) only if it would have passed the checks: one bogus
    late frame per round would otherwise keep a ghost's mark from ever holding."""
    rnd, keys = _late_round()
    s, e = rnd.bounds[0]
    nan = torch.full((e - s,), float("nan"))
    for bad in (dict(part=1), dict(weight=1e9), dict(values=nan), dict(codec="fp16")):
        v, frame = _late_push(rnd, keys, 3, **bad)
        assert not rnd.valid_late_push(3, v.message)
        rnd.accept(keys[3].peer_id, v, len(frame), frame)
        assert 3 not in rnd.pushers, bad
    v, frame = _late_push(rnd, keys, 3)
    rnd.accept(keys[3].peer_id, v, len(frame), frame)
    assert 3 in rnd.pushers and rnd.dropped[3] == DEADLINE_DROP  # late, still dropped: not averaged
    assert 3 in rnd.late_to_us()  # and sent our reduced part (Averager._send_mean_late)
    assert not rnd.valid_late_push(None, v.message)

    rnd, keys = _late_round()  # finished: a late push is checked alike (peer.allreduce_inbound, QuietMembers.late)
    rnd.retire()
    assert not rnd.valid_late_push(3, _late_push(rnd, keys, 3, weight=2.0)[0].message)
    assert rnd.valid_late_push(3, _late_push(rnd, keys, 3)[0].message)

    rnd, keys = _late_round()  # a member not dropped whose push comes after we stopped collecting
    v, frame = _late_push(rnd, keys, 2, values=torch.full((e - s,), float("inf")))
    rnd.accept(keys[2].peer_id, v, len(frame), frame)
    assert 2 not in rnd.pushers and rnd.dropped[2].startswith("PushSlice:")  # refused, as on time


def test_a_late_push_shows_life_only_once_it_covers_the_whole_slice():
    """One valid chunk of many is no sign of life: a ghost sending one chunk late every round
    would clear its mark for a few bytes, and get our whole reduced part for it. The chunks
    of a late push count once each (a resend is no more), none may overlap another, and the
    member counts as late, not gone, when they cover its slice."""
    rnd, keys = _late_round(chunk=64)
    s, e = rnd.bounds[0]  # 256 elements: four chunks
    spans = [(a, min(a + 64, e)) for a in range(s, e, 64)]
    assert len(spans) == 4
    for k, span in enumerate(spans):
        v, frame = _late_push(rnd, keys, 3, span=span)
        rnd.accept(keys[3].peer_id, v, len(frame), frame)
        if k < 3:
            assert 3 not in rnd.pushers and not rnd.late_to_us()
            rnd.accept(keys[3].peer_id, v, len(frame), frame)  # the same chunk again: no more than once
            assert 3 not in rnd.pushers
    assert 3 in rnd.pushers and rnd.late_to_us() == {3}

    rnd, keys = _late_round(chunk=64)  # after the round, alike
    rnd.retire()
    assert not any(rnd.valid_late_push(3, _late_push(rnd, keys, 3, span=span)[0].message) for span in spans[:3])
    assert not rnd.valid_late_push(3, _late_push(rnd, keys, 3, span=(s + 32, s + 96))[0].message)  # off the grid
    assert rnd.valid_late_push(3, _late_push(rnd, keys, 3, span=spans[3])[0].message)


def test_when_every_other_member_is_quiet_no_other_push_part_or_report_is_needed_to_stop_waiting():
    """In a pair with a quiet partner (or a group of quiet members only) nobody else can show
    that we are early rather than they silent: each phase waits for them only the grace."""
    keys = [Identity.from_seed(bytes([i + 1]) * 32).public_key for i in range(2)]
    group = Group(run_id=b"r" * 20, fragment=0, round=1, group_id=GID, members=tuple(keys), weights=(1.0,) * 2,
                  numel=1024, codec="fp32", deadline_s=10.0)
    rnd = Round(group, 0, torch.zeros(1024), get_codec("fp32"))
    assert not rnd.pushes_done_but_quiet() and rnd.means_done_but_quiet() == []
    rnd.quiet = frozenset({1})
    assert rnd.only_quiet_others() and rnd.pushes_done_but_quiet()
    rnd.pushed[1] = rnd.size(0)
    rnd.pushers.add(1)
    assert not rnd.pushes_done_but_quiet()  # it pushed: not silent
    assert rnd.means_done_but_quiet() == [1]  # its part alone is missing
    rnd.early = True  # we heard nobody as the agreement began: its report is waited for
    assert 1 in rnd.took_part() and rnd.agreed_but_quiet() and not rnd.agreed()
    rnd.quiet = frozenset()
    assert not rnd.agreed_but_quiet() and rnd.means_done_but_quiet() == []  # not quiet: the full waits


def test_a_cut_member_whose_valid_push_came_during_the_round_counts_as_heard():
    """An honest member a little more than the grace late is cut; its push still comes while we
    are in the round (its report after we finished). That round counts towards clearing its
    mark, as a push after the round does (a review: marked once, it was cut every round, for
    good, and in a pair waited the means' deadline each time)."""
    quiet = QuietMembers()
    quiet.judge(finished_round(heard=(1, 2)))
    for k in range(CLEAR_AFTER):
        r = finished_round(heard=(1, 2), cut=(3,), gid=bytes([k]) * 16)
        r.pushers.add(3)  # passed the checks (Round.valid_late_push)
        assert quiet.judge(r) == []
    assert "peer3" not in quiet


def test_a_forward_counts_as_delivered_by_its_members_final_else_by_its_acknowledgement():
    """``Round.forwards_undelivered``: a member's final, once in, says whether it landed the part
    as we hold it (it may have got it from another forwarder after ours failed); without its
    final, the send's acknowledgement is all there is. ``forwards_failed``: the members whose
    final is worth waiting for."""
    keys = [Identity.from_seed(bytes([i + 1]) * 32).public_key for i in range(3)]
    group = Group(run_id=b"r" * 20, fragment=0, round=1, group_id=GID, members=tuple(keys), weights=(1.0,) * 3,
                  numel=1024, codec="fp32", deadline_s=10.0)

    async def run():
        rnd = Round(group, 0, torch.zeros(1024), get_codec("fp32"))
        rnd.contributors[2], rnd.mean_chunks[2], rnd.got[2], rnd.frames[2] = (0, 1, 2), [], rnd.size(2), []
        mine = rnd.landed = rnd.digests()  # as Round.land sets it: nothing fell back
        assert mine[2]

        async def sent(ok):
            return ok

        ok, failed = asyncio.create_task(sent(True)), asyncio.create_task(sent(False))
        await asyncio.gather(ok, failed)
        rnd.forwards = [(1, 2, ok)]
        assert rnd.forwards_undelivered() == 0 and rnd.forwards_failed() == []
        rnd.forwards = [(1, 2, failed)]
        assert rnd.forwards_undelivered() == 1 and rnd.forwards_failed() == [1]
        rnd.finals[1] = mine  # it landed the part as we hold it: another forwarder's reached it
        assert rnd.forwards_undelivered() == 0 and rnd.forwards_failed() == []
        rnd.forwards = [(1, 2, ok)]
        rnd.finals[1] = (mine[0], mine[1], b"")  # acknowledged, yet it landed without it
        assert rnd.forwards_undelivered() == 1
        rnd.landed = (mine[0], mine[1], b"")  # we fell back on it in the end too: nothing undelivered
        assert rnd.forwards_undelivered() == 0

    asyncio.run(run())
