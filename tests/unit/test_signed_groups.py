"""The groups a peer signed frames in, kept across restarts (peer.signed_groups): a peer killed
after it sent its final, restarted with the same key and data dir, must not sign another set of
frames for that group, which the members that kept the round would take for a lie (two finals
naming different parts) and ban it for."""

import asyncio

import torch

from peer.allreduce import Averager
from peer.signed_groups import SignedGroups
from protocol.messages_swarm import PartsHeld
from tests.unit.inprocess_group import RUN, InProcessGroup

A, B, C = 0, 1, 2


def test_the_record_survives_a_reopen_skips_torn_lines_and_keeps_the_newest(tmp_path):
    path = tmp_path / "run" / "signed_groups"
    groups = SignedGroups(path, keep=4)
    ids = [bytes([i]) * 16 for i in range(10)]
    groups.add(ids[0])
    groups.add(ids[0])  # once
    assert ids[0] in SignedGroups(path, keep=4) and len(SignedGroups(path, keep=4)) == 1
    with open(path, "a") as f:
        f.write("not hex\nabcd\n" + ids[1].hex()[:7])  # garbage, a short ID, a torn last line
    again = SignedGroups(path, keep=4)
    assert len(again) == 1 and ids[0] in again
    for gid in ids[1:]:
        again.add(gid)
    last = SignedGroups(path, keep=4)
    assert [g in last for g in ids] == [False] * 6 + [True] * 4  # the newest four
    assert len(path.read_text().splitlines()) <= 8  # cut back as it grew past twice the keep
    (tmp_path / "dir").mkdir()
    assert len(SignedGroups(tmp_path / "dir")) == 0  # unreadable: a new record, not a crash


def test_a_member_restarted_after_its_final_takes_no_part_in_that_group_again_and_is_banned_by_nobody(tmp_path):
    """C signs its final for the group and is then restarted (a new Averager, the same key and
    record) while the others still keep the round. Asked to average in the same group again (a
    group's ID follows from its run, round and members), it sends nothing and falls back on
    every part. Without the record it landed alone, told the others a final naming other parts
    than its first one, and they banned it on the pair."""
    async def go(record: bool):
        g = InProcessGroup(3)
        path = tmp_path / f"signed_{record}"
        if record:
            g.averagers[C].signed_groups = SignedGroups(path)
        first = await g.run([A, B, C])
        assert all(o.agreed for o in first.values())
        restarted = Averager(p2p=None, identity=g.keys[C], run_id=RUN, clip=2.0)
        restarted._started = True
        restarted._send_frames = g._sender(C)
        restarted.signed_groups = SignedGroups(path) if record else None
        g.averagers[C] = restarted
        before = len(g.sent)
        out = await asyncio.wait_for(restarted.allreduce(g.group, g.vectors[C], 1.0), timeout=10 * g.group.deadline_s)
        await g.until(lambda: not any(av._side_tasks or av.audits._checking for av in g.averagers))
        convicted = [g.keys[C].public_key in g.averagers[i].audits._convicted for i in (A, B)]
        return out, [m for s, _, m in g.sent[before:] if s == C], convicted

    out, sent, convicted = asyncio.run(go(record=True))
    assert not out.agreed and out.fallback_parts == (A, B, C) and sent == [] and convicted == [False, False]
    out, sent, convicted = asyncio.run(go(record=False))  # what the record prevents
    assert any(isinstance(m, PartsHeld) and m.final for m in sent) and convicted == [True, True]
    assert torch.isfinite(out.average).all()
