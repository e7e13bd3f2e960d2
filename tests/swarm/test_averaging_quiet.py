"""Members silent through a round (peer.quiet), between real peers: one process and one p2pd
each, driven as in test_averaging. A member that joins and then sends nothing (a ghost) holds
the first round it does that in to the push deadline; the rounds after it wait for it only
briefly, and every honest member still lands the same average. A member that comes back on
time is counted again."""

from __future__ import annotations

import pytest
import torch

from peer.simulation import allreduce as simulated_allreduce
from protocol.butterfly import slice_bounds
from protocol.codecs import get_codec
from test_averaging import CLIP, NUMEL, _peer_id, as_tensor, group_fields, make_vector, partial_reference
from test_averaging import swarm  # noqa: F401  (the fixture)
from swarm_util import TIMED

pytestmark = [pytest.mark.swarm, TIMED]
QUIET = "quiet: silent in our last round with it too"


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
            else:  # it failed the round before: dropped soon after the others pushed
                assert any(QUIET in ln for ln in dropped_lines), dropped_lines
                assert elapsed < deadline
            # a late member's report never came: it may have landed parts, so compare states after it
            assert not extra["agreed"]
    # a leader that knows it is quiet gives it no slice (GroupFormed.idle): the three honest
    # members reduce the whole vector, and nothing falls back
    idle = (ghost,)
    fields = {**group_fields(peers, weights, "fp32", group_id=b"ghost-idle".ljust(16, b"\0"), deadline_s=deadline),
              "idle": idle}
    ref = partial_reference(vectors, weights, honest, "fp32", idle)
    replies = _round(peers, honest, fields, seeds)
    for kind, avg, dropped, fallback, _, elapsed, lines, _ in replies.values():
        assert kind == "done" and dropped == (ghost,) and fallback == () and elapsed < deadline
        assert torch.equal(as_tensor(avg), torch.cat([ref[j] for j in honest]))
        assert any(QUIET in ln for ln in lines if "dropped member" in ln and f"peer={ghost_id}" in ln)
    # it comes back and does its part: counted like anyone again
    fields = group_fields(peers, weights, "fp32", group_id=b"ghost-back".ljust(16, b"\0"), deadline_s=deadline)
    replies = _round(peers, [ghost, *honest], fields, seeds)
    expected, _ = simulated_allreduce(vectors, weights, get_codec("fp32"), CLIP)
    for kind, avg, dropped, fallback, *_ in replies.values():
        assert kind == "done" and dropped == () and fallback == ()
        assert torch.equal(as_tensor(avg), expected)


def test_a_member_that_pushes_and_then_falls_silent_holds_one_round_to_the_agreement_deadline(swarm):  # noqa: F811
    """``hush``: it pushes its slices, then sends no reduced part and no report. The first
    round waits for its part to the means' deadline and for its report to the agreement's;
    then it is quiet. In later rounds its contributions count as anyone's, its part (if it
    has one) and its report are waited for only briefly once everyone else's are in, and the
    honest members land one average (not agreed: they compare states after it)."""
    peers = swarm(4)
    weights = [1.0, 2.0, 3.0, 4.0]
    hush, honest, deadline = 3, [0, 1, 2], 6.0
    seeds = {i: 900 + i for i in range(4)}
    vectors = [make_vector(seeds[i]) for i in range(4)]
    hush_id = _peer_id(peers[hush].public_key)
    for name, idle in ((b"hush-1", ()), (b"hush-2", ()), (b"hush-idle", (hush,))):
        fields = {**group_fields(peers, weights, "fp32", group_id=name.ljust(16, b"\0"), deadline_s=deadline),
                  "idle": idle}
        ref = partial_reference(vectors, weights, [0, 1, 2, 3], "fp32", idle)  # its pushes count
        replies = _round(peers, [*honest, hush], fields, seeds, {hush: "hush"})
        for i in honest:
            kind, avg, dropped, fallback, _, elapsed, lines, extra = replies[i]
            got = as_tensor(avg)
            bounds = slice_bounds(NUMEL, 4, idle)
            for j in honest:
                s, e = bounds[j]
                assert torch.equal(got[s:e], ref[j])
            assert not extra["agreed"]  # its report never came: states are compared after the round
            if idle:  # a leader that knows it gives it no part: nothing falls back
                assert kind == "done" and dropped == () and fallback == ()
            else:
                assert kind == "done" and dropped == (hush,) and fallback == (hush,)
            waived = [ln for ln in lines if "report not waited for" in ln and f"peer={hush_id}" in ln]
            if name == b"hush-1":  # a first silence: the means' deadline, then the agreement's
                assert elapsed > 2.5 * deadline - 0.5 and not waived
            else:  # quiet: waited for briefly once every other member's part and report were in
                assert elapsed < deadline and waived, (elapsed, lines[-20:])


@pytest.mark.parametrize("lie", ["ghost", "hush"])
def test_a_pair_with_a_silent_partner_waits_its_deadlines_once_and_then_only_briefly(swarm, lie):  # noqa: F811
    """In a group of two we hear nobody but the partner: a ghost (it took our frames, sent
    nothing) or a hush key (it pushed, then no part and no report) used to hold every round to
    2.5 D, never marked, since a round in which we heard no other member marked nobody. Its
    acknowledgements show it is there: the first round waits the deadlines, the next ones
    only the grace, and we land our own part and keep our values on its (alone in effect)."""
    peers = swarm(2)
    weights, deadline = [1.0, 2.0], 4.0
    seeds = {0: 950, 1: 951}
    vectors = [make_vector(seeds[i]) for i in range(2)]
    bounds = slice_bounds(NUMEL, 2)
    partner = _peer_id(peers[1].public_key)
    for n, name in enumerate((b"pair-1", b"pair-2", b"pair-3")):
        fields = group_fields(peers, weights, "fp32", group_id=(lie.encode() + name).ljust(16, b"\0"),
                              deadline_s=deadline)
        members = [0] if lie == "ghost" else [0, 1]  # a ghost never starts the round
        kind, avg, dropped, fallback, _, elapsed, lines, extra = _round(peers, members, fields, seeds, {1: "hush"})[0]
        assert kind == "done" and dropped == (1,) and fallback == (1,) and not extra["agreed"], lines[-20:]
        got = as_tensor(avg)
        ours = partial_reference(vectors, weights, members, "fp32")[0]  # a hush key's push counts
        assert torch.equal(got[slice(*bounds[0])], ours)
        assert torch.equal(got[slice(*bounds[1])], vectors[0][slice(*bounds[1])])  # its part: our own values
        if n == 0:
            assert elapsed > 2.5 * deadline - 0.5
        else:
            assert elapsed < deadline, (elapsed, lines[-20:])
            assert any(QUIET in ln for ln in lines if f"peer={partner}" in ln), lines[-20:]


def test_a_member_late_past_the_push_deadline_gets_the_others_parts_when_its_push_comes(swarm):  # noqa: F811
    """Member 1 of a pair starts its round 1.25 D after member 0 (busy, or starved): 0 has
    dropped it as late, so 1 is no contributor to 0's part and 0 did not send 1 that part.
    1 used to wait for it until its own means' deadline (1.5 D), then get it forwarded on its
    report. Its push reaching 0 shows it is in the round: 0 sends it its part then, and 1 is
    done at once. Both land the same average (0's part without 1's slice)."""
    peers = swarm(2)
    weights, deadline = [1.0, 2.0], 4.0
    seeds = {0: 960, 1: 961}
    vectors = [make_vector(seeds[i]) for i in range(2)]
    fields = group_fields(peers, weights, "fp32", group_id=b"late-pusher".ljust(16, b"\0"), deadline_s=deadline)
    replies = _round(peers, [0, 1], fields, seeds, {1: f"start:{1.25 * deadline}"})
    (kind0, avg0, dropped0, fallback0, _, _, lines0, _), (kind1, avg1, dropped1, fallback1, _, elapsed1, lines1, _) = \
        replies[0], replies[1]
    assert kind0 == kind1 == "done" and dropped0 == (1,) and dropped1 == () and fallback0 == fallback1 == (), \
        (lines0[-20:], lines1[-20:])
    assert avg0 == avg1, (lines0[-20:], lines1[-20:])
    bounds = slice_bounds(NUMEL, 2)
    assert torch.equal(as_tensor(avg0)[slice(*bounds[0])], vectors[0][slice(*bounds[0])])  # 0's part: its slice alone
    assert elapsed1 < 0.5 * deadline, (elapsed1, lines1[-20:])  # not its means' deadline (1.5 D)
