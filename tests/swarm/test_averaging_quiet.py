"""Members that fail their part of a round (peer.quiet), between real peers: one process and
one p2pd each, driven as in test_averaging. A member that joins and then sends nothing (a
ghost), or pushes and then falls silent, holds the first round it does that in to its
deadlines; the rounds after it wait for it only briefly, and every honest member still lands
the same average. A member that comes back on time is counted again."""

from __future__ import annotations

import pytest
import torch

from peer.allreduce import RESULT_GRACE
from peer.simulation import allreduce as simulated_allreduce
from protocol.butterfly import slice_bounds
from protocol.codecs import get_codec
from test_averaging import CLIP, NUMEL, _peer_id, as_tensor, group_fields, make_vector, partial_reference
import test_averaging
from test_averaging import swarm  # noqa: F401  (the fixture)

pytestmark = pytest.mark.swarm
QUIET = "quiet: it failed its part before"


def _round(peers, members, fields, seeds, behaviour=None):
    """Run one all-reduce on ``members`` (indices into peers), the first listed told first;
    -> their replies by index."""
    for i in members:
        peers[i].cmd.put(("allreduce", fields, seeds[i], (behaviour or {}).get(i, "honest")))
    return {i: peers[i].reply() for i in members}


def test_a_ghost_member_holds_one_round_to_its_deadline_and_the_next_only_briefly(swarm):  # noqa: F811
    peers = swarm(4)
    weights = [1.0, 2.0, 3.0, 4.0]
    ghost, honest, deadline = 3, [0, 1, 2], 10.0
    seeds = {i: 700 + i for i in range(4)}
    vectors = [make_vector(seeds[i]) for i in range(4)]
    ref = partial_reference(vectors, weights, honest, "fp32")
    bounds = slice_bounds(NUMEL, 4)
    ghost_id = _peer_id(peers[ghost].public_key)
    for n, name in enumerate((b"ghost-1", b"ghost-2")):
        # the ghost is a member of the group (it joined, and follows the record) and sends nothing
        fields = group_fields(peers, weights, "fp32", group_id=name.ljust(16, b"\0"), deadline_s=deadline)
        replies = _round(peers, honest, fields, seeds)
        for i, (kind, avg, dropped, fallback, _, elapsed, lines, extra) in replies.items():
            assert kind == "done" and dropped == (ghost,) and fallback == (ghost,)
            got = as_tensor(avg)
            for j in honest:  # the same parts on every honest member, re-weighted over the three
                s, e = bounds[j]
                assert torch.equal(got[s:e], ref[j])
            s, e = bounds[ghost]
            assert torch.equal(got[s:e], vectors[i][s:e])  # its part: our own values (the node's zeros)
            dropped_lines = [ln for ln in lines if "dropped member" in ln and f"peer={ghost_id}" in ln]
            if n == 0:  # a first silence: waited for to the push deadline, as any late member
                assert any("slice not received in time" in ln for ln in dropped_lines)
                assert elapsed > deadline - 0.5
                assert not extra["agreed"]  # a late member's report never came: compare states after it
            else:  # it failed the round before: dropped soon after the others pushed
                assert any(QUIET in ln for ln in dropped_lines), dropped_lines
                assert elapsed < deadline
                assert extra["agreed"]  # a ghost's report is not waited for, nor needed to agree
    # it comes back and does its part: counted like anyone again
    fields = group_fields(peers, weights, "fp32", group_id=b"ghost-back".ljust(16, b"\0"), deadline_s=deadline)
    replies = _round(peers, [ghost, *honest], fields, seeds)
    expected, _ = simulated_allreduce(vectors, weights, get_codec("fp32"), CLIP)
    for kind, avg, dropped, fallback, *_ in replies.values():
        assert kind == "done" and dropped == () and fallback == ()
        assert torch.equal(as_tensor(avg), expected)


def test_a_member_that_pushes_then_falls_silent_is_waited_for_once(swarm):  # noqa: F811
    peers = swarm(4)
    weights = [1.0, 1.0, 2.0, 2.0]
    mute, honest, deadline = 1, [0, 2, 3], 4.0
    seeds = {i: 800 + i for i in range(4)}
    bounds = slice_bounds(NUMEL, 4)
    mute_id = _peer_id(peers[mute].public_key)
    for n, name in enumerate((b"mute-1", b"mute-2")):
        fields = group_fields(peers, weights, "fp32", group_id=name.ljust(16, b"\0"), deadline_s=deadline)
        replies = _round(peers, [mute, *honest], fields, seeds, {mute: "mute"})
        del replies[mute]  # it landed on its own; nobody else holds its part
        for i, (kind, avg, dropped, fallback, _, elapsed, lines, extra) in replies.items():
            assert kind == "done" and dropped == (mute,) and fallback == (mute,)
            got, first = as_tensor(avg), as_tensor(replies[0][1])
            s, e = bounds[mute]
            assert torch.equal(got[s:e], make_vector(seeds[i])[s:e])  # its part: our own values
            assert torch.equal(got[:s], first[:s]) and torch.equal(got[e:], first[e:])  # the rest: one average
            assert bool(torch.isfinite(got).all())
            dropped_lines = [ln for ln in lines if "dropped member" in ln and f"peer={mute_id}" in ln]
            if n == 0:  # its part waited for to the means' deadline, its report to the agreement's
                assert any("reduced part not received in time" in ln for ln in dropped_lines)
                assert elapsed > (1 + RESULT_GRACE) * deadline - 0.5
                assert not extra["agreed"]
            else:
                assert any(QUIET in ln for ln in dropped_lines), dropped_lines
                assert elapsed < (1 + RESULT_GRACE) * deadline
                assert extra["agreed"]


def test_followers_of_a_leader_that_writes_no_group_record_average_together(swarm):  # noqa: F811
    from peer.matchmaking import rank, round_seed

    peers = swarm(3)
    keys = [p.public_key for p in peers]
    ghost, honest, timeout_s = 2, [0, 1], 5.0
    # a round in which the ghost ranks first: it leads the group, and writes no record
    round_ = next(r for r in range(1, 100)
                  if min(keys, key=lambda k: rank(round_seed(test_averaging.RUN_ID, 0, r), k)) == keys[ghost])
    peers[ghost].cmd.put(("join_only", round_, timeout_s, 1.0))
    assert peers[ghost].reply() == ("joined", True)
    for i in honest:
        peers[i].cmd.put(("match", round_, 8, timeout_s, 900 + i, 1.0, 1e18))
    replies = [peers[i].reply() for i in honest]
    groups = [r[1] for r in replies]
    assert all(r[0] == "matched" and g is not None for r, g in zip(replies, groups))  # not alone
    assert groups[0] == groups[1] and groups[0]["members"][0] == keys[ghost]  # one group, the ghost in it
    assert set(groups[0]["members"]) == set(keys)
    n, first = len(keys), as_tensor(replies[0][2])
    s, e = slice_bounds(NUMEL, n)[0]  # the ghost's part (it is member 0): each keeps its own values
    second = as_tensor(replies[1][2])
    assert torch.equal(first[e:], second[e:])  # the honest members' parts: one average
    assert not torch.equal(first[s:e], second[s:e])
    for _, _, _, lines in replies:  # it wrote no record: it failed its part already, no deadline waited for it
        assert any("our leader wrote no group record" in ln for ln in lines)
        assert any("dropped member" in ln and QUIET in ln and f"peer={_peer_id(keys[ghost])}" in ln for ln in lines)
