"""Finals after a round (peer.allreduce, phase 5): what each member landed reaches every other
member, in the round or after it, so a member that said agreed and landed apart finds out and
the node compares its state with the peers' (a repair), and a final that claims a part its
reducer never sends costs one agreement deadline, not one every round. Real Averagers in one
process (tests/unit/inprocess_group.py), one of them lying."""

import asyncio
import dataclasses

import pytest
import torch

from peer.node.faults import make_liar, parse_lies
from protocol.envelope import seal, verify
from protocol.evidence import proves
from protocol.messages_swarm import AuditRequest, PartsHeld, PushSlice, SliceAveraged
from tests.unit.inprocess_group import RUN, InProcessGroup

A, B, L = 0, 1, 2  # two honest members and a liar


def apart_unnoticed(g: InProcessGroup, outs: dict, honest: list[int]) -> list[int]:
    """Honest members that said agreed, hold another result than an honest member, and were not
    told so after the round (``Averager.apart``)."""
    base = outs[honest[0]].average
    apart = any(not torch.equal(base, outs[i].average) for i in honest[1:])
    return [i for i in honest if apart and outs[i].agreed and not g.averagers[i].apart]


def _tiny_norm_to_b(g: InProcessGroup):
    """A policy: the liar's report to B says its push to A's part had a tiny norm (the truth to A)."""
    async def policy(src, dst, data, v):
        m = v.message
        if src == L and dst == B and isinstance(m, PartsHeld) and not m.final:
            norms = list(m.norms)
            norms[A] = 1e-3
            return [seal(dataclasses.replace(m, norms=tuple(norms)), g.keys[L])]
        return [data]
    return policy


def test_a_tiny_norm_told_to_one_member_of_three_is_audited_away_before_it_lands():
    """The liar reports one member a tiny norm of its push to A's part, the other the true one
    (a review's repro: the screens' inputs are the reports each member got). B's norm screen
    refuses A's honest mean of that part; before landing, B audits the part (A shows the signed
    pushes it averaged), the audit passes, and B lands the mean after all: A and B land alike,
    in the round, both saying agreed, and neither stops grouping with the other. Before the
    audit came before the landing, B fell back on the part and the two landed apart."""
    async def go():
        g = InProcessGroup(3, clip=2.0)
        u = torch.ones(8) / 8 ** 0.5
        g.vectors[A][:8], g.vectors[B][:8], g.vectors[L][:8] = 10 * u, u, 10 * u
        g.policy = _tiny_norm_to_b(g)
        outs = await g.run([A, B, L])
        assert g.round_of(B).screen()[0] == [A]  # the lie worked on B's screen
        assert g.round_of(B).cleared == {A}  # and the audit undid it
        assert torch.equal(outs[A].average, outs[B].average)
        assert outs[A].agreed and outs[B].agreed
        assert outs[B].fallback_parts == () and outs[B].refused == ()
        assert not any(g.averagers[i].apart for i in (A, B))
        assert g.averagers[B].audits.counts == {"ok": 1}
        # the audit showed L's signed push of A's part: its report to B understated it, proof of a lie
        [(key, why, proof)] = g.averagers[B].audits.offences
        assert key == g.keys[L].public_key and "norm" in why
        assert proves(list(proof), RUN) == (key, why)
        await g.until(lambda: g.keys[L].public_key in g.averagers[A].audits._convicted)  # handed on, checked by A

    asyncio.run(go())


@pytest.mark.parametrize("how", ["silent", "unreachable"])
def test_a_mean_the_screen_refuses_that_no_audit_shows_falls_back_and_the_round_is_not_agreed(how):
    """The same lie, and A does not answer audits (a reducer killed after its round), or B's
    request cannot reach it (a cut link: no verdict to give, at once): B falls back on the part
    and says not agreed, so the node compares states after the round (A landed the part). A
    is not shut out for good on a refusal nobody proved (``AllReduceOutcome.refused``): the
    audit suspends a reducer that never answers, nothing more."""
    async def go():
        g = InProcessGroup(3, clip=2.0)
        u = torch.ones(8) / 8 ** 0.5
        g.vectors[A][:8], g.vectors[B][:8], g.vectors[L][:8] = 10 * u, u, 10 * u
        if how == "silent":
            g.averagers[A].audits.answer = lambda peer_id, msg: None
        else:
            send = g.averagers[B]._send_frames

            async def no_audits(peer_id, frames):
                if any(isinstance(verify(b"".join(bytes(x) for x in f)).message, AuditRequest) for f in frames):
                    raise ConnectionResetError("unreachable (a test's fault)")
                return await send(peer_id, frames)

            g.averagers[B]._send_frames = no_audits
        g.policy = _tiny_norm_to_b(g)
        outs = await g.run([A, B, L])
        assert outs[B].fallback_parts == (A,) and not outs[B].agreed and outs[B].refused == ()
        assert outs[A].fallback_parts == ()
        assert g.averagers[B].audits.counts == {"unproven": 1}  # (the silent one's, after our wait: it went on)

    asyncio.run(go())


@pytest.mark.parametrize("how", ["no norms", "withheld"])
def test_a_report_without_norms_bounds_nothing_and_refuses_no_honest_part(how):
    """A report to B alone that gives no norms at all, or none sent to B: no norm said, none to
    prove false, so it must not make B refuse A's honest mean (a bound from B's own norm alone
    did, and had A audited every round: two reviews' repros). B lands it without an audit, as
    A does."""
    async def go():
        g = InProcessGroup(3, clip=2.0)
        u = torch.ones(8) / 8 ** 0.5
        g.vectors[A][:8], g.vectors[B][:8], g.vectors[L][:8] = 10 * u, u, 10 * u

        async def policy(src, dst, data, v):
            m = v.message
            if src == L and dst == B and isinstance(m, PartsHeld) and not m.final:
                return [seal(dataclasses.replace(m, norms=()), g.keys[L])] if how == "no norms" else []
            return [data]

        g.policy = policy
        outs = await g.run([A, B, L])
        assert torch.equal(outs[A].average, outs[B].average) and outs[B].fallback_parts == ()
        assert outs[B].agreed  # (a withheld report: L's final told B it finished)
        assert not g.averagers[B].audits.counts

    asyncio.run(go())


def test_in_a_group_of_four_a_tiny_norm_told_to_one_member_refuses_no_honest_part():
    """The same lie from a whole node's liar (``SWARMSTREAM_FAULT=lie:misreport``: its report to
    the member after it says every push of it was 1000 times smaller) in a group of four, the
    vectors as above: the norm screen bounds a part by the largest norm its other contributors
    report, and two of them are honest, so nothing honest is refused and all land alike."""
    async def go():
        g = InProcessGroup(4, clip=2.0)
        u = torch.ones(8) / 8 ** 0.5
        liar = 3
        g.vectors[0][:8], g.vectors[1][:8], g.vectors[2][:8], g.vectors[liar][:8] = 10 * u, u, u, 10 * u
        make_liar(g.averagers[liar], parse_lies("lie:misreport"))
        outs = await g.run([0, 1, 2, liar])
        reports = {d: m.norms for s, d, m in g.sent if s == liar and isinstance(m, PartsHeld) and not m.final}
        assert reports[0] == tuple(x * 1e-3 for x in reports[1]) and reports[1] == reports[2]  # the lie was told
        assert all(outs[i].agreed for i in (0, 1, 2))
        assert all(torch.equal(outs[0].average, outs[i].average) for i in (1, 2))
        assert not any(g.averagers[i].apart for i in (0, 1, 2))

    asyncio.run(go())


def test_an_honest_round_queues_nothing_and_sends_each_final_once():
    async def go():
        g = InProcessGroup(3)
        finals = []  # (from, to) of each member's own final (not one it relays: peer.allreduce_send)

        async def policy(src, dst, data, v):
            if isinstance(v.message, PartsHeld) and v.message.final and v.peer_id == g.keys[src].peer_id:
                finals.append((src, dst))
            return [data]

        g.policy = policy
        outs = await g.run([A, B, L])
        assert all(o.agreed for o in outs.values())
        assert all(torch.equal(outs[A].average, o.average) for o in outs.values())
        assert not any(av.apart for av in g.averagers)
        assert len(finals) == len(set(finals))  # once per pair at most, also to members that finished first

    asyncio.run(go())


def test_a_final_claiming_a_part_its_reducer_never_sends_costs_one_agreement_deadline_not_every_round():
    """The liar pushes, then tells each member in a final that it landed its own part (a digest
    of nothing) and never sends that part: each member waited the agreement's deadline for it,
    round after round, and never marked the liar quiet (a review's repro). Now the first such
    round marks it, and the next waits only the quiet grace."""
    async def go():
        g = InProcessGroup(3)

        async def policy(src, dst, data, v):
            return [data] if src != L or isinstance(v.message, PushSlice) else []  # only its pushes

        g.policy = policy
        for round_ in (1, 2):
            g.group = dataclasses.replace(g.group, round=round_, group_id=bytes([round_]) * 16)

            async def liar(round_=round_):
                await g.until(lambda: g.round_of(L) is not None and g.round_of(L).holds(A) and g.round_of(L).holds(B))
                digests = list(g.round_of(L).digests())
                digests[L] = b"\x42" * 32
                for dst in (A, B):
                    g.inject(L, dst, PartsHeld(run_id=g.group.run_id, fragment=0, round=round_,
                                               group_id=g.group.group_id, digests=tuple(digests), final=True))

            outs = await g.run([A, B, L], beside=liar)
            for i in (A, B):
                assert not outs[i].agreed and L in outs[i].fallback_parts
                assert g.round_of(i).agree_timed_out == (round_ == 1)  # round 2: the quiet grace only
                assert g.keys[L].peer_id in g.averagers[i].quiet
            start, end = g.round_of(A).bounds[L]  # (a part fallen back on holds each member's own values)
            keep = torch.ones_like(outs[A].average, dtype=torch.bool)
            keep[start:end] = False
            assert torch.equal(outs[A].average[keep], outs[B].average[keep])

    asyncio.run(go())


def test_a_later_final_of_a_proven_liar_or_one_that_matches_queues_nothing():
    """Through the handler of a finished round that said agreed: a final equal to what we landed,
    or one from the reducer of a part proven equivocated, says nothing about us; the first
    believed final that differs queues the round once."""
    async def go():
        g = InProcessGroup(3)
        outs = await g.run([A, B, L])
        assert outs[A].agreed and g.round_of(A).said_agreed
        av, rnd = g.averagers[A], g.round_of(A)

        def final(i: int, digests) -> PartsHeld:
            return PartsHeld(run_id=g.group.run_id, fragment=0, round=1, group_id=g.group.group_id,
                             digests=tuple(digests), final=True)

        other = list(rnd.landed)
        other[L] = b""
        rnd.finals.clear()  # (as if they had not come yet)
        g.inject(B, A, final(B, rnd.landed))
        rnd.convicted[L] = (b"m" * 32, b"n" * 32)  # (its two means)
        g.inject(L, A, final(L, other))
        assert not av.apart and rnd.said_agreed
        del rnd.convicted[L]
        del rnd.finals[L]
        g.inject(L, A, final(L, other))
        g.inject(L, A, final(L, other))
        assert len(av.apart) == 1 and not rnd.said_agreed

    asyncio.run(go())


def test_the_node_compares_its_state_after_a_round_found_apart_and_does_not_take_itself_for_behind():
    """The node's side (``SyncMixin._take_verdicts``): a round queued in ``Averager.apart`` makes a
    repair due, as a comparison only: it landed with its group, so catch-up keeps taking peers one
    round ahead for lockstep, not for a sign that it fell behind (which a lone landing is)."""
    from collections import deque
    from types import SimpleNamespace

    from peer.node.syncs import SyncMixin

    node = SimpleNamespace(averager=SimpleNamespace(apart=deque([(0, 7, b"g" * 16), (1, 7, b"h" * 16)])),
                           _repair_due=False, _compare_only=False)
    SyncMixin._take_verdicts(node)
    assert node._repair_due and node._compare_only and not node.averager.apart
    node._repair_due, node._compare_only = True, False  # a lone landing's repair already due stays one
    node.averager.apart.append((0, 8, b"i" * 16))
    SyncMixin._take_verdicts(node)
    assert node._repair_due and not node._compare_only


def test_a_final_from_a_member_we_could_not_reach_still_tells_us_we_landed_apart():
    """Our send to it failed (``unreachable``): a fault of the link, not a lie, so its final is
    believed. It was not, and a member that said agreed and landed apart from it got no note (a
    review's repro: one lost acknowledgement beside a liar)."""
    async def go():
        g = InProcessGroup(3)
        await g.run([A, B, L])
        av, rnd = g.averagers[A], g.round_of(A)
        other = list(rnd.landed)
        other[L] = b""
        rnd.finals.clear()
        rnd.dropped[B] = "unreachable:ConnectionError"
        g.inject(B, A, PartsHeld(run_id=g.group.run_id, fragment=0, round=1, group_id=g.group.group_id,
                                 digests=tuple(other), final=True))
        assert len(av.apart) == 1

    asyncio.run(go())


def test_a_member_that_came_after_every_reducer_finished_marks_none_of_them_quiet():
    """Every other reducer finished before our round began (their finals came first) and none of
    their parts reached us by the agreement's deadline: we were late or cut off, not they. Only a
    reducer whose part is missing while another's came is marked (the liar's case above)."""
    from peer.quiet import FINISHED_DROP, QuietMembers
    from tests.unit.test_finals import member

    rnd = member(0)
    for i in (1, 2):
        rnd.pushers.add(i)
        rnd.heard.add(i)
        rnd.finals[i] = (b"a" * 32, b"b" * 32, b"c" * 32)
        rnd.drop(i, FINISHED_DROP)
    rnd.agree_timed_out = True
    assert QuietMembers().judge(rnd) == []


@pytest.mark.parametrize("n", [3, 4])
def test_a_reducer_that_says_to_one_member_alone_it_fell_back_on_its_late_part_splits_nobody(n):
    """The liar (last member) holds its reduced part back, so every honest member drops it as late;
    once they all hold its report, it tells member 1 alone in a final that it fell back on its own
    part and then hands member 1 the part, which member 1 forwards to the others (a review's repro,
    split in most rounds: member 1 counted the liar's word and fell back, the others, its final
    not in yet, landed the forwarded part). The reducer's final never counts as landing without
    its own part: every honest member lands alike, round after round, and one liar signing one
    final proves nothing."""
    async def go():
        g = InProcessGroup(n)
        liar, honest, held = n - 1, list(range(n - 1)), []

        async def policy(src, dst, data, v):
            if src == liar and isinstance(v.message, SliceAveraged):
                if dst == 0:
                    held.append(data)
                return []  # its part, held back
            if src == liar and isinstance(v.message, PartsHeld) and v.message.final:
                return []  # its own finals: only the one below
            return [data]

        g.policy = policy
        for round_ in (1, 2, 3):
            g.group = dataclasses.replace(g.group, round=round_, group_id=bytes([round_]) * 16)
            held.clear()

            async def lie(round_=round_):
                await g.until(lambda: held and all(g.round_of(i) is not None and g.round_of(i).agreeing
                                                   and liar in g.round_of(i).reports for i in honest))
                without = list(g.round_of(liar).digests())
                without[liar] = b""
                g.inject(liar, 1, PartsHeld(run_id=RUN, fragment=0, round=round_, group_id=g.group.group_id,
                                            digests=tuple(without), final=True))
                for frame in held:
                    g.deliver(liar, 1, frame)
                g.averagers[1]._stream_ended(g.keys[liar].peer_id, set())

            outs = await g.run(list(range(n)), beside=lie)
            assert all(outs[i].fallback_parts == outs[0].fallback_parts for i in honest)
            assert all(torch.equal(outs[0].average, outs[i].average) for i in honest)
            assert liar not in outs[0].fallback_parts  # the part was landed, as the reports showed it held

    asyncio.run(go())
