import pytest
import torch

from peer.model import Transformer, apply_rope, count_params, rope_tables
from protocol.config import PRESETS, ModelConfig


@pytest.mark.parametrize("name", list(PRESETS))
def test_param_count_formula_matches_the_built_model(name):
    cfg = PRESETS[name]
    with torch.device("meta"):  # the 1b preset would take 4 GB for real
        model = Transformer(cfg)
    assert count_params(model) == cfg.num_params()


def test_tiny_is_well_under_a_million_and_150m_and_1b_are_their_size():
    assert PRESETS["tiny"].num_params() < 500_000
    assert 140e6 < PRESETS["150m"].num_params() < 170e6
    assert 0.9e9 < PRESETS["1b"].num_params() < 1.2e9


def test_untied_head_and_gqa_forward_shapes_and_loss():
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, seq_len=16, tie_embeddings=False)
    model = Transformer(cfg)
    x = torch.randint(0, 256, (3, 16))
    logits, loss = model(x, x)
    assert logits.shape == (3, 16, 256)
    # a fresh model predicts close to uniform over 256 bytes
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.3
    assert "head.weight" in dict(model.named_parameters())


def test_causal_the_past_does_not_see_the_future():
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"]).eval()
    x = torch.randint(0, 256, (1, 20))
    y = x.clone()
    y[0, 15:] = (y[0, 15:] + 1) % 256
    la, _ = model(x)
    lb, _ = model(y)
    torch.testing.assert_close(la[0, :15], lb[0, :15])
    assert not torch.allclose(la[0, 15:], lb[0, 15:])


def test_rope_preserves_norm_and_position_zero_is_identity():
    cos, sin = rope_tables(8, 10, 10000.0)
    q = torch.randn(2, 3, 10, 8)
    r = apply_rope(q, cos, sin)
    torch.testing.assert_close(r.norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close(r[:, :, 0], q[:, :, 0])


def test_too_long_sequence_is_a_clear_error():
    model = Transformer(PRESETS["tiny"])
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, PRESETS["tiny"].seq_len + 1, dtype=torch.long))


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    """Recomputing each block in the backward pass (the large presets on a GPU) changes memory,
    not values: the same loss and gradients, bit for bit on CPU."""
    from peer.worker import Worker
    from protocol.config import InnerConfig, SyncConfig, TrainConfig

    cfg = TrainConfig(model=ModelConfig(n_layers=3, d_model=32, n_heads=4, d_ff=64, seq_len=16),
                      inner=InnerConfig(batch_size=2), sync=SyncConfig(fragments=1))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    grads, calls = [], []
    for checkpointing in (False, True):
        w = Worker(cfg, checkpointing=checkpointing)
        n, block = [0], w.model.layers[0]
        forward = block.forward

        def counted(*args, _forward=forward, _n=n):
            _n[0] += 1
            return _forward(*args)

        block.forward = counted
        loss = w.forward_backward([(x, x.roll(-1, 1))])
        grads.append((loss, [p.grad.clone() for p in w.model.parameters()]))
        calls.append(n[0])
    assert calls == [1, 2]  # with checkpointing, the block ran again in the backward pass
    assert grads[0][0] == grads[1][0]
    assert all(torch.equal(a, b) for a, b in zip(grads[0][1], grads[1][1]))
