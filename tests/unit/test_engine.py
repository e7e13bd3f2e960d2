"""The engine's equivalences: DiLoCo degenerates to plain training, ddp to a bigger batch."""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from peer.simulation import Simulation, SimulationConfig, allreduce
from peer.model import Transformer
from peer.worker import Worker, evaluate, lr_at
from protocol.butterfly import FAR, bytes_sent, clip_scale, clip_scales, max_idle, mean_norm_bound, slice_bounds, slice_norm
from protocol.codecs import get_codec
from protocol.config import DataConfig, InnerConfig, ModelConfig, OuterConfig, SyncConfig, TrainConfig

MODEL = ModelConfig(n_layers=2, d_model=32, n_heads=2, d_ff=64, seq_len=16)


def make_cfg(sync: SyncConfig, outer: OuterConfig = OuterConfig(), batch: int = 4) -> TrainConfig:
    return TrainConfig(model=MODEL, data=DataConfig(seed=7),
                       inner=InnerConfig(lr=1e-2, warmup_steps=3, total_steps=30, batch_size=batch), outer=outer,
                       sync=sync)


def batches(n: int, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        w = torch.randint(0, 256, (batch, MODEL.seq_len + 1), generator=g)
        out.append((w[:, :-1], w[:, 1:]))
    return out


def params(w: Worker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in w.model.named_parameters()}


def test_diloco_with_one_worker_lr1_no_momentum_equals_plain_training_step_for_step():
    plain = Worker(make_cfg(SyncConfig(method="ddp")))
    diloco = Worker(make_cfg(SyncConfig(method="diloco", inner_steps=5, fragments=1, overlap=0, alpha=0.0),
                             OuterConfig(lr=1.0, momentum=0.0, nesterov=False)))
    for x, y in batches(20, 4):
        for w in (plain, diloco):
            w.forward_backward([(x, y)])
            w.optimizer_step()
        for p in diloco.schedule.starts_after(diloco.step):
            delta, weight = diloco.begin_sync(p)
            avg, sent = allreduce([delta], [weight], get_codec("fp32"))
            assert sent == [0]
            diloco.apply_outer(p, avg)
        a, b = params(plain), params(diloco)
        for n in a:
            # global - (global - local) == local up to one fp32 rounding per outer step
            torch.testing.assert_close(a[n], b[n], rtol=0, atol=1e-6)
    assert diloco.step == 20
    assert torch.equal(diloco.global_state()["tok_emb.weight"], diloco.model.tok_emb.weight.detach())


def test_ddp_with_m_workers_equals_one_worker_with_an_m_times_batch():
    M, B = 3, 4
    workers = [Worker(make_cfg(SyncConfig(method="ddp"), batch=B)) for _ in range(M)]
    big = Worker(make_cfg(SyncConfig(method="ddp"), batch=M * B))
    codec = get_codec("fp32")
    for step in range(8):
        parts = batches(M, B, seed=100 + step)
        for w, part in zip(workers, parts):
            w.forward_backward([part])
        big.forward_backward([(torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))])
        avg, _ = allreduce([w.grad_vector() for w in workers], [1.0] * M, codec)
        for w in workers:
            w.set_grad_vector(avg)
            w.optimizer_step()
        big.optimizer_step()
    ref = params(big)
    for w in workers:
        for n, p in params(w).items():
            torch.testing.assert_close(p, ref[n], rtol=1e-4, atol=1e-5)


def test_allreduce_counts_butterfly_bytes_and_gives_the_weighted_mean():
    torch.manual_seed(0)
    vecs = [torch.randn(1001) for _ in range(4)]
    weights = [1.0, 2.0, 3.0, 4.0]
    exact = sum(w * v for w, v in zip(weights, vecs)) / sum(weights)
    for name in ("fp32", "int8", "fp4"):
        codec = get_codec(name)
        avg, sent = allreduce(vecs, weights, codec)
        assert sent == bytes_sent(1001, 4, codec.encoded_size)
        # with a clip, each reducer also sends its own slice to its two witnesses
        assert allreduce(vecs, weights, codec, clip=2.0)[1] == bytes_sent(1001, 4, codec.encoded_size, witness=True)
        assert sum(bytes_sent(1001, 4, codec.encoded_size, witness=True)) - sum(sent) == 2 * sum(
            codec.encoded_size(e - s) for s, e in slice_bounds(1001, 4))
        err = (avg - exact).abs().max().item()
        assert err < {"fp32": 1e-6, "int8": 0.05, "fp4": 0.6}[name], (name, err)
    assert slice_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]


def test_idle_members_reduce_nothing_and_the_others_share_the_vector():
    """GroupFormed.idle: an idle member's slice is empty; the others cut the whole vector as
    that many members would, contiguous and in order; at most a third may be idle."""
    assert slice_bounds(10, 4, (1,)) == [(0, 4), (4, 4), (4, 7), (7, 10)]
    assert slice_bounds(10, 4, (0,)) == [(0, 0), (0, 4), (4, 7), (7, 10)]
    for n in range(3, 12):
        for idle in ((), (n - 1,), tuple(range(0, n, 3))[:max_idle(n)]):
            bounds = slice_bounds(1001, n, idle)
            assert bounds[0][0] == 0 and bounds[-1][1] == 1001
            assert all(b[0] == a[1] for a, b in zip(bounds, bounds[1:]))  # contiguous, in member order
            sizes = sorted(e - s for j, (s, e) in enumerate(bounds) if j not in idle)
            assert sizes[-1] - sizes[0] <= 1 and all(bounds[j][0] == bounds[j][1] for j in idle)
    with pytest.raises(ValueError):
        slice_bounds(10, 2, (1,))  # a group of two has no idle member
    with pytest.raises(ValueError):
        slice_bounds(10, 6, (1, 2, 3))


def test_fp4_average_travels_fewer_bytes_than_fp32_by_the_codec_ratio():
    n = 1 << 14
    fp32 = sum(bytes_sent(n, 4, get_codec("fp32").encoded_size))
    fp4 = sum(bytes_sent(n, 4, get_codec("fp4").encoded_size))
    assert 6.0 < fp32 / fp4 <= 8.0


def test_overlap_makes_the_average_visible_exactly_tau_steps_later(tmp_path):
    (tmp_path / "a").mkdir()
    for i in range(40):
        (tmp_path / "a" / f"{i}.txt").write_bytes(bytes(range(256)) * 4 + str(i).encode())
    tc = make_cfg(SyncConfig(method="diloco", inner_steps=8, fragments=2, overlap=2, alpha=0.5, codec="fp4"))
    tc = dataclasses.replace(tc, data=DataConfig(source=str(tmp_path / "a"), heldout_fraction=0.2))
    sim = Simulation(SimulationConfig(train=tc, workers=2, steps=20))
    history = []
    for _ in range(20):
        before = [f.global_flat.clone() for f in sim.workers[0].outer]
        sim.step()
        after = [f.global_flat for f in sim.workers[0].outer]
        history.append([not torch.equal(b, a) for b, a in zip(before, after)])
    changed = {p: [s + 1 for s, row in enumerate(history) if row[p]] for p in range(2)}
    # fragment 0 starts at 4, 12, 20 and fragment 1 at 8, 16; each lands tau = 2 steps later
    assert changed == {0: [6, 14], 1: [10, 18]}
    assert sorted(sim.in_flight) == [0]  # fragment 0's sync after step 20 is still in flight
    # every worker holds the same global copy after every round
    for f0, f1 in zip(sim.workers[0].outer, sim.workers[1].outer):
        assert torch.equal(f0.global_flat, f1.global_flat)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = InnerConfig(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)
    assert lr_at(110, cfg) == pytest.approx(0.1) and lr_at(500, cfg) == pytest.approx(0.1)


@given(st.lists(st.floats(0.75, 1.5), min_size=2, max_size=16), st.floats(1e3, 1e30), st.integers(0, 15))
def test_clipping_leaves_similar_norms_alone_and_bounds_a_liar_by_the_honest_norms(honest, lie, at):
    """Norms within 2x of each other are never scaled (honest rounds are the plain mean); one
    huge norm among them is brought down to at most CLIP x the largest honest one."""
    assert clip_scales(honest, 2.0) == [1.0] * len(honest)
    norms = list(honest)
    norms.insert(at % (len(norms) + 1), lie)
    scaled = [n * s for n, s in zip(norms, clip_scales(norms, 2.0))]
    assert max(scaled) <= 2.0 * max(honest) * (1 + 1e-12)
    assert clip_scales(norms, 0.0) == [1.0] * len(norms)  # clip 0: the plain mean


@given(st.floats(0.0, 1e6), st.floats(1e-6, 1e3), st.floats(1.0, 100.0))
def test_a_contribution_far_beyond_the_median_counts_for_nothing_and_the_scale_is_continuous(norm, median, clip):
    """Up to clip x median a contribution is kept whole; then brought down to that norm; beyond
    FAR x max(1, clip) x median its scale falls linearly, to 0 at twice that. Never above 1, never
    a larger clipped norm than the clip allows, non-decreasing in the median (so a screen that
    knows the median within a range takes its lowest end), and continuous (an auditor's rounding
    of a norm moves the scale by a rounding)."""
    s = clip_scale(norm, median, clip)
    assert 0.0 <= s <= 1.0 and norm * s <= clip * median * (1 + 1e-12)
    far = FAR * clip * median
    if norm <= clip * median:
        assert s == 1.0
    elif norm <= far:
        assert s == pytest.approx(clip * median / norm, rel=1e-12)
    elif norm >= 2 * far:
        assert s == 0.0
    assert clip_scale(norm, median * 1.5, clip) >= s  # a larger median never scales it down more
    for eps in (1e-9, -1e-9):  # no jump anywhere, at the bends either
        assert abs(clip_scale(norm * (1 + eps), median, clip) - s) <= 1e-6


def test_a_liar_in_the_simulated_allreduce_moves_the_clipped_mean_a_bounded_amount():
    g = torch.Generator().manual_seed(5)
    vecs = [torch.randn(1000, generator=g) for _ in range(3)] + [torch.full((1000,), 1e30)]
    codec = get_codec("fp32")
    plain, _ = allreduce(vecs, [1.0] * 4, codec)
    robust, _ = allreduce(vecs, [1.0] * 4, codec, clip=2.0)
    honest = sum(vecs[:3]) / 4
    assert float(plain.abs().max()) > 1e29
    for s, e in slice_bounds(1000, 4):
        bound = 2.0 * max(float(v[s:e].norm()) for v in vecs[:3]) / 4
        assert float((robust[s:e] - honest[s:e]).norm()) <= bound * (1 + 1e-5)
    # far beyond every honest norm, its direction is not kept either: the mean is the honest
    # members' (over all four weights), to the last rounding
    assert torch.allclose(robust, honest, rtol=1e-6, atol=1e-6)
    same, _ = allreduce(vecs[:3], [1.0, 2.0, 3.0], codec, clip=2.0)  # honest: clipping changes no bit
    assert torch.equal(same, allreduce(vecs[:3], [1.0, 2.0, 3.0], codec)[0])


@given(st.integers(0, 10_000), st.lists(st.floats(1e-3, 1e3), min_size=2, max_size=6),
       st.sampled_from(["fp32", "fp4"]))
def test_an_honest_clipped_mean_never_exceeds_the_bound_members_check_it_against(seed, scales, codec_name):
    """Members of very different norms (1e-3 to 1e3 apart) and weights, any codec: each
    reducer's mean stays within ``mean_norm_bound`` of the other contributors' norms, so no
    honest part is ever refused."""
    g = torch.Generator().manual_seed(seed)
    vecs = [torch.randn(600, generator=g) * sc for sc in scales]
    weights = [float(w) for w in torch.rand(len(vecs), generator=g) + 0.1]
    for clip in (1.0, 2.0):
        mean, _ = allreduce(vecs, weights, get_codec(codec_name), clip=clip)
        for j, (s, e) in enumerate(slice_bounds(600, len(vecs))):
            bound = mean_norm_bound([slice_norm(v[s:e]) for i, v in enumerate(vecs) if i != j], clip)
            assert slice_norm(mean[s:e]) <= bound
    assert mean_norm_bound([1.0], 0.0) is None  # the plain mean: nothing bounds it


def test_a_mean_reported_on_only_by_a_slow_member_is_not_refused_at_the_default_clip():
    """Four members, one of them a slow follower whose push is a third the others' norm, and
    only its report came (the others' were lost): the honest mean, about the others' size, is
    within the bound at clip 1 as at clip 2 (a refusal costs an honest reducer our groups)."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(600, generator=g)
    vecs = [base + 0.3 * torch.randn(600, generator=g) for _ in range(3)] + [base / 3]
    for clip in (1.0, 2.0):
        mean, _ = allreduce(vecs, [1.0, 1.0, 1.0, 0.4], get_codec("fp4"), clip=clip)
        for s, e in slice_bounds(600, 4)[:3]:
            assert slice_norm(mean[s:e]) <= mean_norm_bound([slice_norm(vecs[3][s:e])], clip)


def test_evaluating_the_global_model_in_place_matches_a_fresh_copy_and_restores_the_local_weights():
    w = Worker(make_cfg(SyncConfig(method="diloco", inner_steps=3, fragments=2, overlap=0, alpha=0.5)))
    for x, y in batches(7, 4):  # local weights move away from the global copies, some of which step
        w.forward_backward([(x, y)])
        w.optimizer_step()
        for p in w.schedule.starts_after(w.step):
            delta, _ = w.begin_sync(p)
            w.apply_outer(p, delta * 0.5)
    local = params(w)
    held = batches(3, 4, seed=9)
    fresh = Transformer(MODEL)
    fresh.load_state_dict(w.global_state())
    expected = evaluate(fresh, held, torch.device("cpu"))
    assert not torch.equal(local["tok_emb.weight"], w.global_state()["tok_emb.weight"])  # the test means something
    assert w.evaluate_global(held) == expected
    assert all(torch.equal(local[n], p) for n, p in params(w).items())  # bit for bit
    with pytest.raises(RuntimeError, match="boom"), w.global_weights():  # restored on an error too
        raise RuntimeError("boom")
    assert all(torch.equal(local[n], p) for n, p in params(w).items())


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_a_slice_with_no_agreed_mean_keeps_its_local_weights_so_its_progress_goes_into_the_next_sync(alpha):
    """Where the averaging fell back (its reducer failed: a zero averaged delta), the global copy
    moves alike on every member, and the local weights are not reset to it there: the inner
    steps' drift on that slice is in the fragment's next pseudo-gradient, not lost."""
    w = Worker(make_cfg(SyncConfig(method="diloco", inner_steps=4, fragments=1, overlap=0, alpha=alpha)))
    for x, y in batches(4, 4):
        w.forward_backward([(x, y)])
        w.optimizer_step()
    delta, _ = w.begin_sync(0)
    n = delta.numel()
    kept = ((n // 4, n // 2), (3 * n // 4, n))
    before = w.outer[0].local_flat()
    avg = delta * 0.5
    for start, end in kept:
        avg[start:end] = 0.0
    w.apply_outer(0, avg, kept)
    after, glob = w.outer[0].local_flat(), w.outer[0].global_flat
    merged = glob if alpha == 0.0 else before * alpha + glob * (1 - alpha)
    mask = torch.zeros(n, dtype=torch.bool)
    for start, end in kept:
        mask[start:end] = True
    assert torch.equal(after[mask], before[mask])  # the progress there stays
    torch.testing.assert_close(after[~mask], merged[~mask], rtol=0, atol=1e-7)  # merged elsewhere, as without keep
    assert not torch.equal(before[~mask], after[~mask])  # (the test means something)
    # the next pseudo-gradient holds the whole drift there: the global copy minus the kept weights
    assert torch.equal(w.outer[0].pseudo_gradient()[mask], (glob - before)[mask])
    # ranges falling back again in the next sync (a liar reducing them every time) are reset,
    # not carried a second round: the local weights there would drift without bound
    delta, _ = w.begin_sync(0)
    avg = torch.zeros_like(delta)
    before = w.outer[0].local_flat()
    w.apply_outer(0, avg, ((n // 4, n // 2 + 8),))  # overlapping the last sync's first range, and 8 more
    after, glob = w.outer[0].local_flat(), w.outer[0].global_flat
    merged = glob if alpha == 0.0 else before * alpha + glob * (1 - alpha)
    torch.testing.assert_close(after[n // 4: n // 2], merged[n // 4: n // 2], rtol=0, atol=1e-7)  # carried last
    # time: merged now, as where nothing fell back
    assert torch.equal(after[n // 2: n // 2 + 8], before[n // 2: n // 2 + 8])  # kept: it did not fall back then
    assert w.outer[0].carry(((0, n),)) == ((0, n // 4), (n // 2 + 8, n))  # (the rule itself: not where the
    assert w.outer[0].carry(((0, n),)) == ()  # last sync fell back, kept or not)
    assert w.outer[0].carry(()) == () and w.outer[0].carry(((0, 8),)) == ((0, 8),)
