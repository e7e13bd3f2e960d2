import pytest

from peer.model import Transformer
from protocol.config import ModelConfig
from protocol.errors import LocalProtocolError
from protocol.fragments import SyncSchedule, assign_fragments, fragment_of


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_every_parameter_in_exactly_one_fragment(P, tied):
    cfg = ModelConfig(n_layers=4, d_model=16, n_heads=2, d_ff=32, seq_len=8, tie_embeddings=tied)
    names = [n for n, _ in Transformer(cfg).named_parameters()]
    groups = assign_fragments(names, cfg.n_layers, P)
    flat = [n for g in groups for n in g]
    assert sorted(flat) == sorted(names) and len(flat) == len(set(flat))
    assert all(groups), "every fragment has parameters"


def test_strided_placement_and_non_layer_parameters():
    assert fragment_of("layers.5.attn.wq.weight", 6, 4) == 1
    assert fragment_of("tok_emb.weight", 6, 4) == 0
    assert fragment_of("norm.weight", 6, 4) == 5 % 4
    assert fragment_of("head.weight", 6, 4) == 5 % 4
    with pytest.raises(LocalProtocolError):
        fragment_of("mystery.weight", 6, 4)
    with pytest.raises(LocalProtocolError):
        fragment_of("layers.9.mlp.w_up.weight", 6, 4)


@pytest.mark.parametrize("H,P,tau", [(1, 1, 0), (50, 1, 0), (12, 3, 2), (10, 4, 1), (7, 3, 0), (100, 5, 5)])
def test_schedule_syncs_each_fragment_once_per_H_steps(H, P, tau):
    s = SyncSchedule(H, P, tau)
    steps = 6 * H
    starts = {p: [t for t in range(1, steps + 1) if p in s.starts_after(t)] for p in range(P)}
    for p in range(P):
        assert starts[p][0] == (p + 1) * H // P == s.offset(p)
        assert all(b - a == H for a, b in zip(starts[p], starts[p][1:]))
        assert len(starts[p]) == 6
        assert [s.round_of(p, t) for t in starts[p]] == list(range(6))
        lands = [t for t in range(1, steps + 1) if p in s.lands_after(t)]
        assert lands == [t + tau for t in starts[p] if t + tau <= steps]
        assert s.next_start(p, 1) == s.offset(p) and s.next_start(p, starts[p][0] + 1) == starts[p][1]
    # offsets are spread: no two fragments start at the same step
    assert len({s.offset(p) for p in range(P)}) == P


def test_schedule_rejects_overlap_that_would_run_into_the_next_sync():
    with pytest.raises(LocalProtocolError):
        SyncSchedule(10, 2, 5)
    with pytest.raises(LocalProtocolError):
        SyncSchedule(3, 4, 0)


@pytest.mark.parametrize("H,P,tau", [(1, 1, 0), (12, 3, 2), (10, 4, 1), (100, 5, 5)])
def test_a_state_stands_right_before_its_first_sync_not_done_whenever_it_was_landed(H, P, tau):
    """``step_of``: one step for the rounds done, whatever step a peer landed them at (on time,
    late, or moved on as a follower), so peers holding one copy vouch for one digest."""
    s = SyncSchedule(H, P, tau)
    assert s.step_of([0] * P) == s.offset(0) - 1  # nothing done: before the first sync
    done = [0] * P
    for step in range(1, 5 * H + 1):  # land each sync on time, then check where the state stands
        for p in s.lands_after(step):
            done[p] += 1
            at = s.step_of(done)
            assert at >= step  # never before the step it was landed at ...
            nxt = min(s.next_start(q, step + 1) for q in range(P))
            assert at == nxt - 1  # ... and right before the next sync any fragment starts
