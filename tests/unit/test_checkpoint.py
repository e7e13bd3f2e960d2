import pytest
import torch

from peer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from peer.data import ShardSampler
from peer.worker import Worker
from protocol.config import DataConfig, InnerConfig, ModelConfig, SyncConfig, TrainConfig

CFG = TrainConfig(model=ModelConfig(n_layers=2, d_model=32, n_heads=2, d_ff=64, seq_len=16), data=DataConfig(seed=1),
                  inner=InnerConfig(warmup_steps=2, total_steps=20, batch_size=4),
                  sync=SyncConfig(inner_steps=4, fragments=2, overlap=1, alpha=0.5, codec="fp4"))
TOKENS = (torch.arange(5000, dtype=torch.int32) * 7) % 256
RUN = b"r" * 20


def train(worker, sampler, steps):
    for _ in range(steps):
        worker.forward_backward([sampler.next_batch()])
        worker.optimizer_step()
        for p in worker.schedule.starts_after(worker.step):
            delta, _ = worker.begin_sync(p)
            worker.apply_outer(p, delta * 0.5)


def test_restart_from_checkpoint_continues_exactly_as_if_never_stopped(tmp_path):
    a, sa = Worker(CFG), ShardSampler(TOKENS, 16, 4, 1, "w")
    train(a, sa, 6)
    save_checkpoint(tmp_path / "ckpt", a, sa, run_id=RUN, rounds=[1, 1])
    train(a, sa, 6)

    b, sb = Worker(CFG), ShardSampler(TOKENS, 16, 4, 1, "w")
    assert load_checkpoint(tmp_path / "ckpt", b, sb, run_id=RUN) == [1, 1]
    train(b, sb, 6)
    assert b.step == a.step == 12 and b.tokens == a.tokens
    for (n, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), n
    for fa, fb in zip(a.outer, b.outer):
        assert torch.equal(fa.global_flat, fb.global_flat)


def test_bad_checkpoints_are_refused_and_leave_the_worker_untouched(tmp_path):
    a, sa = Worker(CFG), ShardSampler(TOKENS, 16, 4, 1, "w")
    train(a, sa, 3)
    save_checkpoint(tmp_path / "ckpt", a, sa, run_id=RUN, rounds=[0, 0])
    fresh, sf = Worker(CFG), ShardSampler(TOKENS, 16, 4, 1, "w")
    before = [p.detach().clone() for p in fresh.model.parameters()]
    with pytest.raises(CheckpointError, match="another run"):
        load_checkpoint(tmp_path / "ckpt", fresh, sf, run_id=b"x" * 20)
    other = Worker(TrainConfig(model=ModelConfig(n_layers=2, d_model=16, n_heads=2, d_ff=64, seq_len=16),
                               sync=CFG.sync))
    with pytest.raises(CheckpointError, match="does not match|shape"):
        load_checkpoint(tmp_path / "ckpt", other, sf, run_id=RUN)
    (tmp_path / "ckpt" / "tensors.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="damaged"):
        load_checkpoint(tmp_path / "ckpt", fresh, sf, run_id=RUN)
    assert all(torch.equal(b, p) for b, p in zip(before, fresh.model.parameters()))
    assert fresh.step == 0
