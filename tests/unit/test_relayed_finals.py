"""Relayed finals (peer.allreduce_send, phase 5 of peer.allreduce_round): a member that finishes
sends the others its final and, with it, the finals it got from the rest, as they signed them;
a final that comes after we landed and names other parts is relayed to the others. Two finals
one key signed for one round that name different parts prove that it told members different
things about what it landed (protocol.evidence.contradicting_finals): every member that sees
the pair bans it and hands the proof on. Honest finals, however late, prove nothing."""

import asyncio
import dataclasses
import random

import pytest
import torch

from peer.allreduce_send import SIDE_RESENDS
from peer.bans import Bans
from peer.node.faults import make_liar, parse_lies
from protocol.envelope import seal, verify
from protocol.evidence import contradicting_finals, proves
from protocol.identity import Identity
from protocol.messages_swarm import PartsHeld
from tests.unit.inprocess_group import RUN, InProcessGroup

A, B, L = 0, 1, 2  # two honest members and a liar
KEY, OTHER = Identity.from_seed(b"\x31" * 32), Identity.from_seed(b"\x32" * 32)


def parts_held(digests, final=True, round_=1, group_id=b"g" * 16, signer=KEY) -> bytes:
    return seal(PartsHeld(run_id=RUN, fragment=0, round=round_, group_id=group_id, digests=tuple(digests),
                          final=final), signer)


def test_two_finals_of_one_round_naming_different_parts_prove_a_lie_and_nothing_else_does(tmp_path):
    landed, without = (b"a" * 32, b"b" * 32, b"c" * 32), (b"a" * 32, b"", b"c" * 32)
    proof = (parts_held(landed), parts_held(without))
    assert contradicting_finals(*proof, RUN)[0] == KEY.public_key
    assert proves(proof, RUN)[0] == KEY.public_key
    assert "two different finals" in proves(proof, RUN)[1]
    for pair in [(parts_held(landed), parts_held(landed)),  # a resend
                 (parts_held(landed), parts_held(without, round_=2)),  # two rounds
                 (parts_held(landed), parts_held(without, group_id=b"h" * 16)),  # two groups
                 (parts_held(landed, final=False), parts_held(without)),  # a report, then the final
                 (parts_held(landed), parts_held(without, signer=OTHER))]:  # two members
        assert contradicting_finals(*pair, b"\x00" * 20) is None
        assert contradicting_finals(*pair, RUN) is None and proves(pair, RUN) is None
    bans = Bans(tmp_path / "bans", RUN)
    assert bans.add(KEY.public_key, "finals", proof)
    again = Bans(tmp_path / "bans", RUN)
    again.load()  # the proof is checked again from disk
    assert again.peer_ids == {KEY.peer_id} and "two different finals" in again.reason(KEY.public_key)


def _finals_of_l_differ(g: InProcessGroup, to: int):
    """A policy: the liar's own final to member ``to`` says it fell back on its own part."""
    async def policy(src, dst, data, v):
        m = v.message
        if src == L and dst == to and isinstance(m, PartsHeld) and m.final and v.peer_id == g.keys[L].peer_id:
            digests = list(m.digests)
            digests[L] = b""
            return [seal(dataclasses.replace(m, digests=tuple(digests)), g.keys[L])]
        return [data]
    return policy


async def _settled(g: InProcessGroup, members) -> None:
    """The proofs handed on between members checked (each a side task of its receiver)."""
    await g.until(lambda: not any(g.averagers[i].audits._checking or g.averagers[i]._side_tasks for i in members))


def test_a_liar_that_tells_two_members_different_finals_is_proven_and_banned_by_both():
    """The liar's final to A says it fell back on its own part, its final to B the truth. A's
    came after A landed, names other parts than A landed, and A relays it; B holds the pair,
    bans the liar and hands the proof to A, which bans it too. Before relays each member held
    one final of the liar's and nothing proved that it lied (each round it could make a member
    compare states, and never be shut out)."""
    async def go():
        g = InProcessGroup(3)
        g.policy = _finals_of_l_differ(g, A)
        outs = await g.run([A, B, L])
        await _settled(g, (A, B))
        assert torch.equal(outs[A].average, outs[B].average)
        for i in (A, B):
            audits = g.averagers[i].audits
            assert g.keys[L].public_key in audits._convicted
            [(key, why, proof)] = list(audits.offences)  # what the node bans with and keeps (peer.bans)
            assert key == g.keys[L].public_key and proves(proof, RUN)[0] == key
            assert g.keys[A].public_key not in audits._convicted and g.keys[B].public_key not in audits._convicted

    asyncio.run(go())


def test_a_liars_final_that_came_before_we_landed_travels_with_our_final_and_proves_the_lie():
    """The liar sends its finals early (before A and B land), A's naming other parts than B's;
    its own later finals are swallowed. A holds the liar's final as it lands and sends it to B
    with its own final, and B, holding the other, proves the lie. A's final report to B carried
    the liar's signed final."""
    async def go():
        g = InProcessGroup(3)
        carried = []

        async def policy(src, dst, data, v):
            if src == L and isinstance(v.message, PartsHeld) and v.message.final:
                return []  # its own finals: only the early ones below
            if isinstance(v.message, PartsHeld) and v.message.final and v.peer_id != g.keys[src].peer_id:
                carried.append((src, dst, g.index[v.peer_id]))
            return [data]

        g.policy = policy

        async def liar():
            await g.until(lambda: g.round_of(L) is not None and all(g.round_of(L).holds(j) for j in range(3)))
            digests = list(g.round_of(L).digests())
            g.inject(L, B, PartsHeld(run_id=RUN, fragment=0, round=1, group_id=g.group.group_id,
                                     digests=tuple(digests), final=True))
            digests[L] = b""
            g.inject(L, A, PartsHeld(run_id=RUN, fragment=0, round=1, group_id=g.group.group_id,
                                     digests=tuple(digests), final=True))

        outs = await g.run([A, B, L], beside=liar)
        await _settled(g, (A, B))
        assert torch.equal(outs[A].average, outs[B].average)
        assert (A, B, L) in carried or (B, A, L) in carried  # a relayed final of the liar's
        for i in (A, B):
            assert g.keys[L].public_key in g.averagers[i].audits._convicted

    asyncio.run(go())


def test_honest_finals_relayed_however_late_prove_nobody_and_leave_every_round_alike():
    """Four honest members over six rounds; the reports to members 2 and 3 held back (so they
    land after 0 and 1, and 2 before 3, holding 0's and 1's finals), and every other final,
    and every relay of one, held back a random while (up to 1.5 deadlines), so finals come
    before, during and after the others land and get relayed.
    Nobody is proven or banned. (A round may land apart when members finish with different
    views; then none of them goes on believing it agreed.)"""
    async def go():
        g = InProcessGroup(4, deadline_s=0.5)
        rng = random.Random(7)
        relays = []

        async def policy(src, dst, data, v):
            if isinstance(v.message, PartsHeld) and v.message.final:
                if v.peer_id != g.keys[src].peer_id:
                    relays.append((src, dst))
                elif dst == 2 and src in (0, 1):
                    return [data]
                await asyncio.sleep(rng.uniform(0, 0.75))
            elif isinstance(v.message, PartsHeld) and dst in (2, 3):  # on its way a while (its sender goes on)
                asyncio.get_running_loop().call_later(0.15 if dst == 2 else 0.45, g.deliver, src, dst, data)
                return []
            return [data]

        g.policy = policy
        for round_ in range(1, 7):
            g.group = dataclasses.replace(g.group, round=round_, group_id=bytes([round_]) * 16)
            outs = await g.run(list(range(4)))
            await _settled(g, range(4))
            if not all(torch.equal(outs[0].average, o.average) for o in outs.values()):
                assert all(not o.agreed or any(a[1] == round_ for a in g.averagers[i].apart) for i, o in outs.items())
        assert relays  # relays did happen (finals came after some members had landed)
        for av in g.averagers:
            assert not av.audits._convicted and not av.audits.offences

    asyncio.run(go())


def test_a_relayed_final_of_someone_outside_the_group_or_of_another_round_is_not_taken():
    """A final signed by a key outside the group, relayed by a member, is not taken; nor is a
    member's final that names another round than its group's (taken first, it would stand, and
    its final of the group's round, naming other parts, would prove nothing against it)."""
    async def go():
        g = InProcessGroup(3)
        outs = await g.run([A, B, L])
        assert all(o.agreed for o in outs.values())
        rnd = g.round_of(A)
        before = dict(rnd.finals)
        stranger = parts_held(rnd.landed, group_id=g.group.group_id, signer=OTHER)
        g.deliver(B, A, stranger)  # B hands A a final signed by a key not in the group
        assert rnd.finals == before and not g.averagers[A].audits._convicted
        assert verify(stranger).peer_id not in rnd.index
        del rnd.finals[L], rnd.final_frames[L]
        g.deliver(L, A, parts_held((b"",) * 3, round_=7, group_id=g.group.group_id, signer=g.keys[L]))
        assert L not in rnd.finals

    asyncio.run(go())


def _final(g: InProcessGroup, digests) -> PartsHeld:
    return PartsHeld(run_id=RUN, fragment=0, round=g.group.round, group_id=g.group.group_id,
                     digests=tuple(digests), final=True)


def test_a_relayed_final_naming_other_parts_makes_a_member_that_said_agreed_compare_states():
    """After a round all said agreed, the liar tells B alone it fell back on its own part; B
    relays that final to A, which, like B, no longer takes the round for agreed (before, only a
    final sent to A by its signer did: a helper's repro)."""
    async def go():
        g = InProcessGroup(3)

        async def policy(src, dst, data, v):
            return [] if src == L and isinstance(v.message, PartsHeld) and v.message.final else [data]

        g.policy = policy
        outs = await g.run([A, B, L])
        assert outs[A].agreed and outs[B].agreed
        digests = list(g.round_of(L).landed)
        digests[L] = b""
        g.inject(L, B, _final(g, digests))
        await _settled(g, (A, B))
        for i in (A, B):
            assert not g.round_of(i).said_agreed and len(g.averagers[i].apart) == 1

    asyncio.run(go())


def test_two_finals_buffered_before_the_round_started_prove_the_lie_and_each_relayed_final_goes_once():
    """The liar's two different finals reach B before B starts the round (buffered, then taken
    as the round starts): B bans the liar and hands the proof to A although no other final
    reaches B (before, the proof waited for one: a helper's repro). And the liar's reports sent
    again and again after the round get A's own final each time, the finals A holds once (they
    went with every answer: n - 1 frames a report)."""
    async def go():
        g = InProcessGroup(3)
        g.inject(L, B, _final(g, (b"x" * 32, b"", b"")))
        g.inject(L, B, _final(g, (b"", b"y" * 32, b"")))

        async def policy(src, dst, data, v):
            final = isinstance(v.message, PartsHeld) and v.message.final
            return [] if final and (dst == B or src == L) else [data]

        g.policy = policy
        await g.run([A, B, L])
        await _settled(g, (A, B))
        for i in (A, B):
            assert g.keys[L].public_key in g.averagers[i].audits._convicted
        g.policy = None
        report = g.round_of(A).report_frames[L]
        before = len(g.sent)
        for _ in range(10):
            g.deliver(L, A, report)
        await _settled(g, (A,))
        answers = [(s, d, m) for s, d, m in g.sent[before:] if s == A and d == L]
        assert len(answers) <= 10 + 1  # our final each time, B's final (all we hold but the liar's own) once

    asyncio.run(go())


@pytest.mark.parametrize("n", [3, 4])
def test_the_finals_lie_of_the_swarm_tests_is_proven_by_every_honest_member(n):
    """``SWARMSTREAM_FAULT=lie:finals`` (``peer.node.faults``): the liar's final to the member
    after it says it fell back on every part, the true one to the others. Every honest member
    bans it on the pair, and they land alike."""
    async def go():
        g = InProcessGroup(n)
        liar = n - 1
        make_liar(g.averagers[liar], parse_lies("lie:finals"))
        outs = await g.run(list(range(n)))
        await _settled(g, range(n - 1))
        for i in range(n - 1):
            assert [k for k, *_ in g.averagers[i].audits.offences] == [g.keys[liar].public_key]
            assert torch.equal(outs[0].average, outs[i].average)

    asyncio.run(go())


def test_a_relayed_final_that_comes_before_the_round_started_is_buffered_and_proves_the_lie():
    """A lands first and relays the liar's final to B, which has not started the round; the liar
    tells B another final. Both wait in B's buffer and are taken as B starts (the relayed one as
    the liar's, not as A's): B holds the pair and bans the liar. Before, a relay for a group not
    started was dropped, and nobody held both finals (a review's finding)."""
    async def go():
        g = InProcessGroup(3)
        landed, without = (b"a" * 32, b"b" * 32, b"c" * 32), (b"a" * 32, b"b" * 32, b"")
        g.deliver(A, B, parts_held(landed, group_id=g.group.group_id, signer=g.keys[L]))  # A relays it
        g.deliver(L, B, parts_held(without, group_id=g.group.group_id, signer=g.keys[L]))

        async def policy(src, dst, data, v):
            return [] if src == L and isinstance(v.message, PartsHeld) and v.message.final else [data]

        g.policy = policy
        await g.run([A, B, L])
        await _settled(g, (A, B))
        assert A not in g.round_of(B).finals or g.round_of(B).finals[A] != landed  # (not taken as A's)
        for i in (A, B):
            assert [k for k, *_ in g.averagers[i].audits.offences] == [g.keys[L].public_key]

    asyncio.run(go())


def test_a_relay_that_was_not_delivered_goes_again_to_that_member():
    """The liar tells A alone that it fell back on its own part; A's relay of that final to B
    fails on the way (the connection breaks after A's own final went), and nothing else brings
    B the liar's two finals (B's relays to A are lost). A sends the relay again (after D/2), and B holds
    the pair and bans the liar. Before, a relay was marked sent before it was acknowledged, and a
    lost one never went again."""
    async def go():
        g = InProcessGroup(3)
        lie_to_a = _finals_of_l_differ(g, A)
        broke = []

        async def policy(src, dst, data, v):
            m = v.message
            relay_of_l = isinstance(m, PartsHeld) and m.final and v.peer_id == g.keys[L].peer_id and src != L
            if relay_of_l and src == B:
                return []  # B's relays of the liar's (true) final to A: lost
            if relay_of_l and src == A and dst == B and not broke:
                broke.append(1)
                raise ConnectionError("stream reset")
            return await lie_to_a(src, dst, data, v)

        g.policy = policy
        await g.run([A, B, L])
        await _settled(g, (A, B))
        assert broke and g.round_of(A).resent == {B: 1}
        # the relay goes again after D/2, with A's final: B then holds the pair and hands the proof on
        await g.until(lambda: all(g.averagers[i].audits.offences for i in (A, B)))
        await _settled(g, (A, B))
        for i in (A, B):
            assert [k for k, *_ in g.averagers[i].audits.offences] == [g.keys[L].public_key]

    asyncio.run(go())


def test_a_member_that_never_acknowledges_gets_the_relays_again_twice_at_most():
    """Every send to the liar that carries a relay fails (it acknowledges no relay) and it
    reports again and again after the round: a failed side send goes again at most
    ``SIDE_RESENDS`` times a member and round, so its reports get our final each time and B's
    relayed final three times at most (with no cap each answer would carry it again)."""
    async def go():
        g = InProcessGroup(3)
        tried = []  # (signer) of each final A tried to send the liar

        async def policy(src, dst, data, v):
            if dst == L and isinstance(v.message, PartsHeld) and v.message.final:
                if src == A:
                    tried.append(g.index[v.peer_id])
                if v.peer_id != g.keys[src].peer_id:  # a relay (it comes after our own final in a send)
                    raise ConnectionError("never acknowledged")
            return [data]

        g.policy = policy
        await g.run([A, B, L])
        await _settled(g, (A, B))
        if B not in g.round_of(A).final_frames:  # (B tells A its final only if A's did not come first)
            g.inject(B, A, _final(g, g.round_of(B).landed))
        report = g.round_of(A).report_frames[L]
        for _ in range(10):
            g.deliver(L, A, report)
            await _settled(g, (A,))
        assert g.round_of(A).resent[L] == SIDE_RESENDS
        assert 1 <= tried.count(B) <= 1 + SIDE_RESENDS
        assert 10 <= tried.count(A) <= 1 + 10 + SIDE_RESENDS

    asyncio.run(go())
