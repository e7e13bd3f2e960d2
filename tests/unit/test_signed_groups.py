"""The groups a peer signed frames in, kept across restarts (peer.signed_groups): a peer killed
after it sent its final, restarted with the same key and data dir, must not sign another set of
frames for that group, which the members that kept the round would take for a lie (two finals
naming different parts) and ban it for."""

import asyncio

import torch

from peer.allreduce import Averager
from peer.signed_groups import SignedGroups
from protocol.errors import LocalProtocolError
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
    unreadable = SignedGroups(tmp_path / "dir")  # (a directory in its place)
    assert len(unreadable) == 0 and not unreadable.add(ids[0])  # not written: nothing may be signed for it
    assert ids[0] in unreadable and not unreadable.reserve(ids[0])  # and never averaged in by this process


def test_an_append_after_a_torn_last_line_keeps_the_new_id_and_a_group_is_reserved_once(tmp_path):
    path = tmp_path / "signed_groups"
    path.write_text((bytes([1]) * 16).hex() + "\n" + (bytes([2]) * 16).hex()[:9])  # torn as it was appended
    groups = SignedGroups(path)
    assert groups.add(bytes([3]) * 16)
    again = SignedGroups(path)
    assert bytes([1]) * 16 in again and bytes([3]) * 16 in again and bytes([2]) * 16 not in again
    assert groups.reserve(bytes([4]) * 16) and not groups.reserve(bytes([4]) * 16)  # a second call for one group


def test_a_member_restarted_after_its_final_takes_no_part_in_that_group_again_and_is_banned_by_nobody(tmp_path):
    """C signs its final for the group and is then restarted (a new Averager, the same key and
    record) while the others still keep the round. Asked to average in the same group again (a
    group's ID follows from its run, round and members), it sends nothing and the round fails
    (the node averages it alone). Without the record it landed alone, told the others a final
    naming other parts than its first one, and they banned it on the pair."""
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
        try:
            out = await asyncio.wait_for(restarted.allreduce(g.group, g.vectors[C], 1.0),
                                         timeout=10 * g.group.deadline_s)
        except LocalProtocolError as e:  # the node averages that round alone
            out = e
        await g.until(lambda: not any(av._side_tasks or av.audits._checking for av in g.averagers))
        convicted = [g.keys[C].public_key in g.averagers[i].audits._convicted for i in (A, B)]
        return out, [m for s, _, m in g.sent[before:] if s == C], convicted

    out, sent, convicted = asyncio.run(go(record=True))
    assert isinstance(out, LocalProtocolError) and "before a restart" in str(out)
    assert sent == [] and convicted == [False, False]
    out, sent, convicted = asyncio.run(go(record=False))  # what the record prevents
    assert any(isinstance(m, PartsHeld) and m.final for m in sent) and convicted == [True, True]
    assert torch.isfinite(out.average).all()
