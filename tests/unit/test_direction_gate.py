"""The direction gate (``protocol.gate.robust_factors``, a run's ``sync.gate``): after the
clip, a slice that points against the sum of the others' terms counts for nothing. Its rule is
one that every check of a reducer recomputes, so each is held to it: the reducer, the
simulation, the audit (which must accept either decision for a slice on the gate's line, and
convict a reducer that gated an honest slice or let a gated one through), the screen (which
must let an honest gated mean pass), and the manifest (a run made before the gate keeps its
rules)."""

from __future__ import annotations

import dataclasses
import typing

import pytest

import torch
from hypothesis import given, settings, strategies as st

from peer import simulation
from protocol.audit import OK, WRONG, check
from protocol.butterfly import GATE_SLACK, slice_bounds, slice_norm
from protocol.gate import Gate, gram, robust_factors
from protocol.codecs import get_codec
from protocol.config import CODEC_NAMES, SyncConfig, TrainConfig, to_dict
from protocol.identity import Identity
from protocol.manifest import RunManifest, SwarmConfig, open_manifest, sign_manifest
from protocol.messages import decode, encode
from tests.unit.test_audit import RUN, reduce_and_audit
from tests.unit.test_mean_screen import group, reduce_part, screen, witnessed_screen

N = 640


def _factors(vecs: list[torch.Tensor], clip: float = 1.0, gate: bool = True,
             shares: list[float] | None = None) -> tuple[list[float], frozenset[int]]:
    shares = shares or [1.0 / len(vecs)] * len(vecs)
    return robust_factors([slice_norm(v) for v in vecs], shares, clip, gate, lambda: gram([vecs]))


def test_a_slice_against_the_others_counts_for_nothing_and_the_mean_is_over_the_others():
    vecs, _ = group(1, 4, 0.3, 1.1)
    vecs[3] = -2.0 * vecs[3]  # a liar pushing its own pseudo-gradient backwards, twice
    factors, gated = _factors(vecs)
    assert gated == {3} and factors[3] == 0.0
    plain, none = _factors(vecs, gate=False)
    assert none == frozenset()
    # the honest terms keep their clip scale, over the weight kept: 3 of 4 equal shares
    assert factors[:3] == pytest.approx([p * 4 / 3 for p in plain[:3]], rel=1e-12)


def test_the_gate_takes_out_at_most_a_third_of_the_weight():
    vecs, _ = group(2, 4, 0.3, 1.1)
    vecs[3] = -2.0 * vecs[3]
    assert _factors(vecs, shares=[0.2, 0.2, 0.2, 0.4])[1] == frozenset()  # it weighs more than a third
    assert _factors(vecs, shares=[0.25] * 4)[1] == {3}


@pytest.mark.parametrize("k", [3, 4, 6, 8])
def test_a_liar_aimed_at_one_honest_push_is_taken_out_and_that_push_kept(k):
    """The liar pushes against one honest member's push, at the honest norm, so that the
    others' sum points against that push too: taken out first (its cosine is the lowest), it
    leaves the honest one with the others again. A rule that took out every push against the
    others at once took both, or (over a third of the weight, in a group of 4) neither."""
    for seed in range(10):
        vecs, _ = group(seed, k, 0.1, 1.05)
        target = vecs[0]
        vecs[-1] = -target * (slice_norm(vecs[1]) / slice_norm(target))
        shares = [1.0 / k] * k
        g = gram([vecs])
        at_once = [i for i in range(k) if float(sum(g[i, j] for j in range(k) if j != i)) < 0]
        assert 0 in at_once and k - 1 in at_once  # the target, too, points against the others' sum
        assert _factors(vecs)[1] == {k - 1}
        assert Gate([1.0 / k] * k, shares, g).possible() == {frozenset({k - 1})}


def test_the_gate_does_nothing_in_pairs_or_without_a_clip_and_keeps_one_slice_at_least():
    a = torch.randn(N, generator=torch.Generator().manual_seed(0))
    assert _factors([a, -a])[1] == frozenset()  # a pair that disagrees: each against the other, half each
    assert _factors([a, -a, -a], clip=0.0)[1] == frozenset()  # the plain mean stays plain
    # three slices each pointing against the sum of the other two, alike: one goes (the lowest
    # cosine; a tie, by index), and each of the two left is half the weight
    e = torch.eye(3, dtype=torch.float32)
    rim = [e[0] - 0.6 * (e[1] + e[2]), e[1] - 0.6 * (e[0] + e[2]), e[2] - 0.6 * (e[0] + e[1])]
    gate = Gate([1 / 3] * 3, [1 / 3] * 3, gram([rim]))
    assert gate.gated() == {0}
    assert gate.possible() == {frozenset({0}), frozenset({1}), frozenset({2})}  # a tie: any, for an audit


def test_a_slice_on_the_gates_line_may_go_either_way_for_an_audit():
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(N, generator=g), torch.randn(N, generator=g)
    rest = (a + b).double()
    c = torch.randn(N, generator=g).double()
    c = (c - c.dot(rest) / rest.dot(rest) * rest).float()  # orthogonal to a + b
    gate = Gate([1 / 3] * 3, [1 / 3] * 3, gram([[a, b, c]]))
    assert gate.possible() == {frozenset(), frozenset({2})}
    assert gate.gated() in gate.possible()


def test_one_of_three_equal_members_may_be_gated_and_a_set_at_the_limit_either_way_for_an_audit():
    g = torch.tensor([[1.0, 0.5, -0.6], [0.5, 1.0, -0.6], [-0.6, -0.6, 1.0]], dtype=torch.float64)
    third = Gate([1 / 3] * 3, [1 / 3] * 3, g)
    assert third.gated() == {2} and third.possible() == {frozenset({2})}  # a third, give or take a rounding
    heavier = Gate([0.3, 0.3, 0.4], [0.3, 0.3, 0.4], g)
    assert heavier.gated() == frozenset() and heavier.possible() == {frozenset()}
    edge = 1 / 3 + GATE_SLACK  # at the limit: an auditor's sum of the shares may fall on either side of it
    shares = [(1 - edge) / 2, (1 - edge) / 2, edge]
    at_limit = Gate(shares, shares, g)
    assert at_limit.possible() == {frozenset(), frozenset({2})} and at_limit.gated() in at_limit.possible()


@given(st.integers(0, 10_000), st.integers(3, 6), st.sampled_from([-1.0, 0.0, 0.3, 0.9]),
       st.sampled_from(CODEC_NAMES), st.sampled_from([1.0, 2.0]))
@settings(max_examples=150, deadline=None)
def test_the_node_and_the_simulation_reduce_alike_and_no_honest_gated_mean_is_refused(seed, k, rho, codec_name, clip):
    """The simulation's arithmetic is the reducer's (``reduce_part``), and every member's screen
    under the gate lets its honest means pass, with a member pushing against the others
    (``rho`` -1) or without."""
    vecs, weights = group(seed, k, max(rho, 0.0), 1.5)
    if rho < 0:
        vecs[-1] = -2.0 * vecs[-1]
    codec = get_codec(codec_name)
    sim, _ = simulation.allreduce(vecs, weights, codec, clip, gate=True)
    for j, (s, e) in enumerate(slice_bounds(N, k)):
        payload, mean, pushes = reduce_part(vecs, weights, j, codec, clip, gate=True)
        assert torch.equal(mean, sim[s:e])
        assert screen(mean, payload, pushes, weights, j, codec, clip, gate=True)
        if k > 2:
            assert witnessed_screen(mean, payload, pushes, weights, j, codec, clip, gate=True)


def test_the_screen_under_the_gate_still_refuses_a_negated_mean_or_one_inflated_beyond_its_room_or_shrunk():
    """The kept factors grow by up to 1.5 under the gate, but they still sum to 1: a mean shrunk
    x0.2 fits no choice of kept contributions (a first version let every factor be anything
    from 0 to 1.5 alone, and such a mean passed every screen: ``bench/witness.py --gate``)."""
    refused = 0
    for seed in range(10):
        vecs, _ = group(seed, 6, 0.7, 1.1)
        weights = [1.0] * 6
        codec = get_codec("fp4")
        for j, (s, e) in enumerate(slice_bounds(N, 6)):
            _, mean, pushes = reduce_part(vecs, weights, j, codec, 1.0, gate=True)
            for lie in (-1.0, 3.0, 0.2):
                payload = codec.encode(mean * lie)
                told = codec.decode(payload, e - s)
                refused += not witnessed_screen(told, payload, pushes, weights, j, codec, 1.0, gate=True)
    assert refused == 10 * 6 * 3


def _gating_round(lie=None, gate=True):
    vecs = [v.repeat(4) for v in group(7, 4, 0.5, 1.1)[0]]  # 4 x 640 elements per part
    vecs[2] = -2.0 * vecs[2]  # member 2 pushes against the others: gated by an honest reducer
    return reduce_and_audit(vecs, "fp4", (1.0, 2.0, 1.5, 1.0), 1.0, 256, lie, gate=gate), vecs


def test_an_honest_gating_reducer_passes_its_audit_and_is_proven_wrong_only_by_other_rules():
    (means, shown, rnd), _ = _gating_round()
    assert rnd.gated == [2]
    assert check(means, shown, RUN, 1.0, gate=True)[0] == OK
    # an auditor that does not gate (another version of the rules) would convict it: hence the
    # manifest field, so that every member of a run audits by the run's rules
    assert check(means, shown, RUN, 1.0, gate=False)[0] == WRONG


def test_a_reducer_that_lets_a_gated_slice_through_or_gates_an_honest_one_is_proven_wrong():
    (means, shown, rnd), vecs = _gating_round(gate=False)  # it did not gate member 2
    assert rnd.gated == []
    verdict, _, why = check(means, shown, RUN, 1.0, gate=True)
    assert verdict == WRONG, why
    s, e = rnd.bounds[0]
    codec = get_codec("fp4")

    def gate_member_1_too(mean, vectors):  # an honest slice (member 1, weight 2) left out as well
        own = codec.decode(codec.encode(vectors[1][s:e]), e - s)
        return mean - 2.0 / 5.5 * own

    (means, shown, _), _ = _gating_round(gate_member_1_too)
    verdict, _, why = check(means, shown, RUN, 1.0, gate=True)
    assert verdict == WRONG, why


def test_a_manifest_made_before_the_gate_keeps_its_rules_and_a_new_one_gates():
    ident = Identity.from_seed(b"\x11" * 32)
    new = RunManifest(name="r", description="", train=TrainConfig(), swarm=SwarmConfig(),
                      creator=ident.public_key, created_at=1.0)
    assert new.train.sync.gate is True
    assert open_manifest(sign_manifest(new, ident)).manifest.train.sync.gate is True
    assert decode(encode(dataclasses.replace(new, train=TrainConfig(sync=SyncConfig(gate=False))))).train.sync.gate \
        is False
    # the train map as a version before the gate wrote it (no such key), read by the manifest's own rule
    rule = typing.get_type_hints(RunManifest, include_extras=True)["train"].__metadata__[0]
    before = to_dict(new.train)
    del before["sync"]["gate"]
    assert rule.check(before, "train").sync.gate is False
    assert "gate" not in before["sync"]  # the map given is left alone
    assert TrainConfig().sync.gate is True  # a config file without the key: the default of new runs
    # a run made without the gate is written as a version before it wrote it: older clients open it
    plain = dataclasses.replace(new, train=TrainConfig(sync=SyncConfig(gate=False)))
    assert "gate" not in rule.to_wire(plain.train)["sync"] and "gate" in rule.to_wire(new.train)["sync"]
    assert decode(encode(plain)).train.sync.gate is False
