"""The in-round screen of a reduced part (``protocol.butterfly.mean_consistent``): with one
number per member (the dot of the mean with its own push), no honest mean is ever refused,
over codecs, clips, group sizes, weights, norm spreads and correlations, also when some
members could not say; a negated or inflated mean is refused. And the codecs' error bounds
(``Codec.error_bound``) hold, since the screen's soundness rests on them."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peer import simulation
from peer.simulation import allreduce
from protocol.butterfly import median_range, screen_mean, slice_bounds, slice_norm
from protocol.codecs import get_codec
from protocol.config import CODEC_NAMES

N = 640


@given(st.sampled_from(CODEC_NAMES), st.integers(1, 2000), st.integers(-30, 30), st.integers(0, 4),
       st.integers(0, 10_000))
@settings(max_examples=300, deadline=None)
def test_a_codecs_error_bound_holds_for_any_input(name, n, exponent, kind, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 2.0 ** exponent
    if kind == 1:
        x = x ** 3
    elif kind == 2:
        x[::7] *= 1000
    elif kind == 3:
        x = torch.zeros(n)
        x[0] = 2.0 ** exponent
    elif kind == 4:
        x = torch.rand(n, generator=g) * 2.0 ** exponent
    codec = get_codec(name)
    data = codec.encode(x)
    err = float(torch.linalg.vector_norm(codec.decode(data, n).double() - x.double()))
    assert err <= codec.error_bound(data, n)


def group(seed: int, k: int, rho: float, spread: float):
    """k pseudo-gradients of N elements with pairwise correlation about ``rho``, norms up to
    ``spread`` apart, and random weights."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(N, generator=g)
    vecs = [(math.sqrt(rho) * common + math.sqrt(1 - rho) * torch.randn(N, generator=g))
            * float(1 + (spread - 1) * torch.rand(1, generator=g)) for _ in range(k)]
    weights = [float(w) for w in torch.rand(k, generator=g) + 0.1]
    return vecs, weights


def reduce_part(vecs, weights, j: int, codec, clip: float, gate: bool = False):
    """Part j as its reducer j computes it: -> (payload, decoded mean, the members' slices as
    the reducer averaged them (its own raw))."""
    total = float(sum(weights))
    payload, slices, _ = simulation.reduce_part(vecs, [w / total for w in weights], j, codec, clip, gate)
    return payload, codec.decode(payload, slices[j].numel()), slices


def screen(mean, payload, pushes, weights, j: int, codec, clip: float, said=None, lies=None, gate: bool = False) -> bool:
    """What every member decides from the reports (``Round.inconsistent``): members in ``said``
    (all, by default) reported their dot; ``lies``: member -> the (weight, norm, dot) it
    reported instead of the truth."""
    others = [i for i in range(len(pushes)) if i != j]
    reports = {i: (weights[i], slice_norm(pushes[i]),
                   float(torch.dot(mean.double(), pushes[i].double())) if said is None or i in said else None)
               for i in others}
    reports.update(lies or {})
    return screen_mean(slice_norm(mean), codec.error_bound(payload, mean.numel()), clip, weights[j],
                       [reports[i] for i in others], gate=gate, numel=mean.numel())


@given(st.integers(0, 10_000), st.integers(2, 6), st.sampled_from([-0.1, 0.0, 0.3, 0.9]),
       st.sampled_from([1.0, 1.5, 1e3]), st.sampled_from(CODEC_NAMES), st.sampled_from([1.0, 2.0, 4.0]),
       st.booleans())
@settings(max_examples=300, deadline=None)
def test_no_honest_mean_is_refused(seed, k, rho, spread, codec_name, clip, some_silent):
    vecs, weights = group(seed, k, max(rho, 0.0), spread)
    if rho < 0:  # one member pulls against the others
        vecs[0] = -vecs[0]
    codec = get_codec(codec_name)
    sim, _ = allreduce(vecs, weights, codec, clip=clip)
    for j, (s, e) in enumerate(slice_bounds(N, k)):
        payload, mean, pushes = reduce_part(vecs, weights, j, codec, clip)
        assert torch.equal(mean, sim[s:e])  # the reducer's arithmetic, as the swarm's
        said = set(range(1, k, 2)) if some_silent else None
        assert screen(mean, payload, pushes, weights, j, codec, clip, said)


@given(st.integers(0, 10_000), st.integers(3, 6), st.sampled_from([0.0, 0.5, 0.9]), st.sampled_from(CODEC_NAMES),
       st.integers(0, 5), st.sampled_from([-1e6, -10.0, -1.0, 0.0, 10.0, 1e6]),
       st.sampled_from([None, 0.0, 1e-3, 1.0, 1e3]))
@settings(max_examples=300, deadline=None)
def test_one_members_false_report_cannot_make_an_honest_mean_fail(seed, k, rho, codec_name, who, dot, norm):
    """Whatever one member other than the reducer reports (its dot x -1e6 .. 1e6, or none; its
    norm 0 .. x1e3, or no report at all), every honest part passes: the screen refuses a mean
    only if it fits no world with one liar."""
    vecs, weights = group(seed, k, rho, 1.5)
    codec = get_codec(codec_name)
    for j in range(k):
        payload, mean, pushes = reduce_part(vecs, weights, j, codec, 2.0)
        liar = [i for i in range(k) if i != j][who % (k - 1)]
        true_dot = float(torch.dot(mean.double(), pushes[liar].double()))
        said = (weights[liar], None if norm is None else norm * slice_norm(pushes[liar]),
                None if dot == 0.0 or norm is None else dot * abs(true_dot) + dot)
        assert screen(mean, payload, pushes, weights, j, codec, 2.0, lies={liar: said})


@given(st.integers(0, 10_000), st.sampled_from([6, 8]), st.sampled_from([0.3, 0.7]),
       st.sampled_from(["fp4", "int8", "fp32"]))
@settings(max_examples=100, deadline=None)
def test_a_negated_or_inflated_mean_is_refused(seed, k, rho, codec_name):
    """Members of similar norms and equal weights, clip 1 (the default) and 2, groups of 6 or more
    whose pseudo-gradients agree some (``bench/screen.py`` measures a real run's): a reducer
    that negates its mean, or scales it x3 (inside the norm bound), is refused by the dots. A
    negated mean is also refused when the member after the reducer could not say its dot (the
    mean was withheld from it), when the pseudo-gradients agree more."""
    vecs, _ = group(seed, k, rho, 1.1)
    weights = [1.0] * k
    codec = get_codec(codec_name)
    for clip in (1.0, 2.0):
        for j, (s, e) in enumerate(slice_bounds(N, k)):
            _, mean, pushes = reduce_part(vecs, weights, j, codec, clip)
            lies = [(-1.0, None), (3.0, None)]
            if k >= 6 and rho >= 0.7:
                lies.append((-1.0, set(range(k)) - {(j + 1) % k}))
            for lie, said in lies:
                payload = codec.encode(mean * lie)
                told = codec.decode(payload, e - s)
                assert not screen(told, payload, pushes, weights, j, codec, clip, said), (clip, lie, said)


def test_weights_without_a_positive_total_and_groups_of_one_say_nothing():
    """A leader may form a group whose members' weights are 0 (only their sum must be positive):
    a reducer counting only such members gives no total to divide by, and is not screened."""
    assert screen_mean(1.0, 0.0, 2.0, 0.0, [(0.0, 1.0, 0.5)])
    assert screen_mean(1.0, 0.0, 2.0, 1.0, [])  # a reducer that counted only itself
    assert screen_mean(1.0, 0.0, 0.0, 1.0, [(1.0, 1.0, -5.0)])  # the plain mean: no clip


def test_the_lower_median_of_a_part_when_some_norms_may_be_anything():
    assert median_range([1.0]) == (0.0, 1.0)  # two members: the reducer can be the lower median
    assert median_range([3.0, 1.0]) == (1.0, 3.0)
    assert median_range([4.0, 1.0, 2.0]) == (1.0, 2.0)
    assert median_range([3.0, 1.0], unknown=2) == (0.0, 3.0)
    assert median_range([3.0], unknown=2) == (0.0, math.inf)  # two of three unknown decide it
    for known in ([1.0], [3.0, 1.0], [4.0, 1.0, 2.0], [5.0, 1.0, 2.0, 4.0]):  # by brute force
        for unknown in (1, 2, 3):
            meds = [sorted([*known, *[r] * unknown])[(len(known) + unknown - 1) // 2] for r in (0.0, 2.5, 1e9)]
            low, high = median_range(known, unknown)
            assert low == min(meds) and (high == max(meds) or (high == math.inf and max(meds) == 1e9))


def witnessed_screen(mean, payload, slices, weights, j: int, codec, clip: float, lies=None, witnesses=2,
                     gate: bool = False) -> bool:
    """What every member decides with part j's witnesses' vouches (``Round.inconsistent``): the
    reducer's own slice (as it averaged it: ``slices[j]``) vouched for by members ``j + 1`` and
    ``j + 2`` (``witnesses`` of them); ``lies``: member -> (its own entry, its vouch or None)
    instead of the truth (a lying witness may lie in both)."""
    k = len(slices)
    dots = [float(torch.dot(mean.double(), x.double())) for x in slices]
    others = [i for i in range(k) if i != j]
    entries = {i: (weights[i], slice_norm(slices[i]), dots[i]) for i in others}
    vouches = {(j + 1 + t) % k: (slice_norm(slices[j]), dots[j]) for t in range(witnesses)}
    for i, (entry, vouch) in (lies or {}).items():
        entries[i] = entry
        if i in vouches:
            if vouch is None:
                del vouches[i]
            else:
                vouches[i] = vouch
    return screen_mean(slice_norm(mean), codec.error_bound(payload, mean.numel()), clip, weights[j],
                       [entries[i] for i in others], reporters=others,
                       vouched=[(w, n, d) for w, (n, d) in sorted(vouches.items())], gate=gate, numel=mean.numel())


@given(st.integers(0, 10_000), st.integers(3, 6), st.sampled_from([0.0, 0.5, 0.9]), st.sampled_from(CODEC_NAMES),
       st.booleans(), st.sampled_from([-1e6, -3.0, -1.0, 0.0, 10.0]), st.sampled_from([0.0, 1e-3, 1.0, 1e3]))
@settings(max_examples=300, deadline=None)
def test_one_members_false_report_cannot_make_an_honest_mean_fail_with_witnesses(seed, k, rho, codec_name,
                                                                                 witness_lies, dot, norm):
    """A witness reports two terms (its own and the reducer's): a lying witness may falsify
    both, or vouch for nothing; another member its one; whatever they say, every honest part
    passes."""
    vecs, weights = group(seed, k, rho, 1.5)
    codec = get_codec(codec_name)
    for j in range(k):
        payload, mean, slices = reduce_part(vecs, weights, j, codec, 2.0)
        liar = (j + 1) % k if witness_lies else (j + 3) % k
        if liar == j:
            continue
        true = [float(torch.dot(mean.double(), x.double())) for x in slices]
        entry = (weights[liar], norm * slice_norm(slices[liar]), dot * abs(true[liar]) + dot)
        vouch = None if norm == 0.0 else (norm * slice_norm(slices[j]), dot * abs(true[j]) - dot)
        assert witnessed_screen(mean, payload, slices, weights, j, codec, 2.0, lies={liar: (entry, vouch)})


@given(st.integers(0, 10_000), st.sampled_from([3, 4, 5]), st.sampled_from([0.3, 0.73]))
@settings(max_examples=60, deadline=None)
def test_with_two_witnesses_a_negated_mean_is_refused_in_groups_of_3_to_5(seed, k, rho):
    """What the witnesses are for: in groups of 3-5 (fp4, clip 2, equal weights) the screen
    without them lets a negated mean through (the reducer's own term may be anything up to the
    clip); with the reducer's own slice vouched for by two witnesses, it is refused. One
    witness is not enough: in the world in which it lies, the reducer's term is unknown again."""
    vecs, _ = group(seed, k, rho, 1.1)
    weights = [1.0] * k
    codec = get_codec("fp4")
    one = 0
    for j, (s, e) in enumerate(slice_bounds(N, k)):
        _, mean, slices = reduce_part(vecs, weights, j, codec, 2.0)
        payload = codec.encode(-mean)
        told = codec.decode(payload, e - s)
        assert not witnessed_screen(told, payload, slices, weights, j, codec, 2.0)
        one += not witnessed_screen(told, payload, slices, weights, j, codec, 2.0, witnesses=1)
    if k < 5:
        assert one == 0


def _padded(codec_name: str, payload: bytes, numel: int) -> bytes:
    """``payload`` with its first block's codes all zero and its scale the largest the codec
    takes: it decodes to zeros there, finite and no larger, as a liar could send it."""
    b = bytearray(payload)
    if codec_name == "fp4":  # ceil(n / 32) bf16 scales, then the packed codes
        b[0:2] = torch.tensor([5.0e37], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
        at = 2 * -(-numel // 32)
        b[at:at + 16] = bytes(16)
    else:  # int8: ceil(n / 256) fp32 scales, then the values
        b[0:4] = struct.pack("<f", 2.6e36)
        at = 4 * -(-numel // 256)
        b[at:at + 256] = bytes(256)
    return bytes(b)


@pytest.mark.parametrize("codec_name", ["fp4", "int8"])
@pytest.mark.parametrize("k", [3, 4, 8])
def test_a_block_of_zeros_with_a_huge_scale_does_not_widen_the_screen(codec_name, k):
    """The codec's error bound (the screen's room for rounding) is taken from what a block's
    codes say its scale was, not from the scale the bytes claim: a reducer that pads its
    negated mean with one block of zeros scaled to 1e37 is refused as the plain lie is."""
    codec = get_codec(codec_name)
    n = 600 * k  # int8 slices of more than a block: the padded one is not the whole mean
    for seed in range(3):
        vecs, _ = group(seed, k, 0.73, 1.1)
        vecs = [torch.cat([v] * (n // N + 1))[:n] for v in vecs]
        weights = [1.0] * k
        for j, (s, e) in enumerate(slice_bounds(n, k)):
            _, mean, slices = reduce_part(vecs, weights, j, codec, 2.0)
            honest = codec.encode(mean)
            padded = _padded(codec_name, codec.encode(-mean), e - s)
            told = codec.decode(padded, e - s)
            assert torch.isfinite(told).all() and float(told[:32].abs().max()) == 0.0
            assert codec.error_bound(padded, e - s) <= codec.error_bound(honest, e - s)
            assert not witnessed_screen(told, padded, slices, weights, j, codec, 2.0)
            assert witnessed_screen(codec.decode(honest, e - s), honest, slices, weights, j, codec, 2.0)


def test_a_members_entries_are_one_members_word():
    """The screen's one liar covers all of a member's entries and its vouch; two vouches that
    disagree cannot both be true."""
    entries = [(1.0, 1.0, 1.0), (1.0, 1.0, 1.0)]
    with pytest.raises(ValueError):
        screen_mean(1.0, 0.0, 2.0, 1.0, entries, reporters=[0])
    # a mean of norm 1 whose dots say it is -x: refused unless some member's word is the lie
    far = [(1.0, 1.0, -1.0), (1.0, 1.0, -1.0), (1.0, 1.0, -1.0)]
    assert not screen_mean(1.0, 0.0, 2.0, 1.0, far, vouched=[(0, 1.0, -1.0), (1, 1.0, -1.0)])
    assert screen_mean(1.0, 0.0, 2.0, 1.0, far, reporters=[0, 0, 1], vouched=[(0, 1.0, -1.0)])


def test_a_reducer_that_counted_only_itself_must_return_its_vouched_own_slice():
    x = torch.randn(N, generator=torch.Generator().manual_seed(7))
    codec = get_codec("fp4")
    data = codec.encode(x)
    own = codec.decode(data, N)
    for told, ok in ((own, True), (-own, False), (3 * own, False)):
        payload = codec.encode(told)
        m = codec.decode(payload, N)
        vouch = (slice_norm(own), float(torch.dot(m.double(), own.double())))
        assert screen_mean(slice_norm(m), codec.error_bound(payload, N), 2.0, 1.0, [],
                           vouched=[(1, *vouch), (2, *vouch)]) is ok
        assert screen_mean(slice_norm(m), codec.error_bound(payload, N), 2.0, 1.0, [], vouched=[(1, *vouch)])


@pytest.mark.parametrize("gate", [False, True])
def test_an_honest_fp32_mean_of_subnormal_pushes_passes(gate):
    """Float32 rounding below the normal range is absolute (2^-149 a step): eight pushes of
    6 x 2^-149 each, at a share of 1/8, round to a mean of 8 x 2^-149, a third off, which the
    relative room did not allow (a review's repro: refused in every world, no liar at all)."""
    vecs = [torch.full((N,), 6 * 2.0 ** -149) for _ in range(8)]
    weights = [1.0] * 8
    codec = get_codec("fp32")
    for j in range(8):
        payload, mean, pushes = reduce_part(vecs, weights, j, codec, 1.0, gate=gate)
        assert screen(mean, payload, pushes, weights, j, codec, 1.0, gate=gate)
        assert witnessed_screen(mean, payload, pushes, weights, j, codec, 1.0, gate=gate)
