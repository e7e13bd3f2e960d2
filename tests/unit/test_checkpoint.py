import copy
import hashlib
import json
import logging
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from peer import checkpoint
from peer.checkpoint import (CheckpointError, NonFiniteState, checkpoint_exists, load_checkpoint, prev_path,
                             save_checkpoint)
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


# --- checksums, range checks, the previous checkpoint ----------------------------------------

def _fresh():
    return Worker(CFG), ShardSampler(TOKENS, 16, 4, 1, "w")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A worker trained 4 steps, and a folder holding its checkpoints at step 4 (``checkpoint``)
    and step 2 (``checkpoint.prev``), both with AdamW moments and outer momentum."""
    folder = tmp_path_factory.mktemp("saved")
    w, s = _fresh()
    train(w, s, 2)
    save_checkpoint(folder / "ckpt", w, s, run_id=RUN, rounds=[0, 1])
    train(w, s, 2)
    save_checkpoint(folder / "ckpt", w, s, run_id=RUN, rounds=[1, 1])
    return w, s, folder


@pytest.fixture
def ckpt(saved, tmp_path):
    """A private copy of ``saved``'s folder; returns the latest checkpoint's path."""
    shutil.copytree(saved[2], tmp_path, dirs_exist_ok=True)
    return tmp_path / "ckpt"


def _meta(path):
    return json.loads((path / "meta.json").read_text())


def _rewrite(path, *, meta=None, tensors=None, rehash=True):
    """Change a saved checkpoint's meta fields and/or tensors (a callable on the dict), then
    recompute its checksum unless ``rehash`` is False (a change the checksum must catch)."""
    if tensors is not None:
        t = load_file(str(path / "tensors.safetensors"))
        tensors(t)
        save_file(t, str(path / "tensors.safetensors"))
    m = _meta(path)
    m.update(meta or {})
    if rehash and "sha256" in m:
        m["sha256"] = hashlib.sha256((path / "tensors.safetensors").read_bytes()).hexdigest()
    (path / "meta.json").write_text(json.dumps(m))


def _snapshot(worker):
    return [p.detach().clone() for p in worker.model.parameters()], worker.step


def _untouched(worker, snap):
    params, step = snap
    return worker.step == step and all(torch.equal(a, b) for a, b in zip(params, worker.model.parameters()))


def _files(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_save_records_a_checksum_and_keeps_the_previous_checkpoint(ckpt):
    m, prev = _meta(ckpt), _meta(prev_path(ckpt))
    assert (m["format"], m["step"], m["rounds"]) == (2, 4, [1, 1]) and (prev["step"], prev["rounds"]) == (2, [0, 1])
    for folder, meta in ((ckpt, m), (prev_path(ckpt), prev)):
        assert meta["sha256"] == hashlib.sha256((folder / "tensors.safetensors").read_bytes()).hexdigest()
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["ckpt", "ckpt.prev"]
    assert checkpoint_exists(ckpt)


def _flip_bit(path):
    data = bytearray((path / "tensors.safetensors").read_bytes())
    data[-100] ^= 0x10  # in the last tensor's values, past the header
    (path / "tensors.safetensors").write_bytes(bytes(data))


def _nan_in_model(path):
    def poison(t):
        t[min(k for k in t if k.startswith("model/"))].view(-1)[3] = float("nan")
    _rewrite(path, tensors=poison)  # checksum recomputed: only the finiteness check can catch it


def _inf_in_adam(path):
    _rewrite(path, tensors=lambda t: t["adam/0/exp_avg_sq"].view(-1).__setitem__(0, float("inf")))


def _truncate_tensors(path):
    f = path / "tensors.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _truncate_meta(path):
    f = path / "meta.json"
    f.write_bytes(f.read_bytes()[:40])


LATEST_DAMAGE = {
    "NaN in a weight": (_nan_in_model, "NaN or inf"),
    "inf in an AdamW moment": (_inf_in_adam, "adam/0/exp_avg_sq holds NaN or inf"),
    "flipped bit": (_flip_bit, "damaged"),
    "truncated tensors": (_truncate_tensors, "damaged"),
    "truncated meta.json": (_truncate_meta, "unreadable"),
    "tensors file missing": (lambda p: (p / "tensors.safetensors").unlink(), "unreadable"),
    "meta.json missing": (lambda p: (p / "meta.json").unlink(), "unreadable"),
    "step = -5": (lambda p: _rewrite(p, meta={"step": -5}), "step must be an integer in 0..2\\*\\*63-1, got -5"),
    "folder missing": (lambda p: shutil.rmtree(p), "missing"),
}


@pytest.mark.parametrize("damage", LATEST_DAMAGE, ids=list(LATEST_DAMAGE))
def test_a_bad_latest_checkpoint_falls_back_to_the_previous_one_with_one_warning(ckpt, damage, caplog):
    spoil, reason = LATEST_DAMAGE[damage]
    spoil(ckpt)
    w, s = _fresh()
    with caplog.at_level(logging.WARNING, logger="peer.checkpoint"):
        assert load_checkpoint(ckpt, w, s, run_id=RUN) == [0, 1]
    assert w.step == 2, "resumed from the previous checkpoint (step 2)"
    [rec] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    msg = rec.getMessage()
    assert "\n" not in msg and re.search(reason, msg) and "previous" in msg, msg
    # the bad one is set aside, so the next save rotates the good one into .prev, not the bad one
    assert not ckpt.exists() and prev_path(ckpt).exists()
    save_checkpoint(ckpt, w, s, run_id=RUN, rounds=[0, 1])
    assert _meta(ckpt)["step"] == _meta(prev_path(ckpt))["step"] == 2
    assert not (ckpt.parent / "ckpt.tmp").exists() and not (ckpt.parent / "ckpt.trash").exists()


def test_without_a_previous_checkpoint_a_bad_one_is_refused_and_the_worker_untouched(ckpt):
    shutil.rmtree(prev_path(ckpt))
    _flip_bit(ckpt)
    w, s = _fresh()
    snap = _snapshot(w)
    with pytest.raises(CheckpointError, match=r"damaged.*move .*ckpt aside to start this run fresh") as e:
        load_checkpoint(ckpt, w, s, run_id=RUN)
    assert "\n" not in str(e.value) and _untouched(w, snap)


BAD_META = {
    "step = -5": ({"step": -5}, "step must be"),
    "step as a string": ({"step": "4"}, "step must be"),
    "step as a float": ({"step": 4.0}, "step must be"),
    "step as a bool": ({"step": True}, "step must be"),
    "step beyond 2**63": ({"step": 2**64}, "step must be"),
    "tokens < 0": ({"tokens": -1}, "tokens must be"),
    "rounds too short": ({"rounds": [1]}, "rounds must be 2 integers"),
    "rounds negative": ({"rounds": [-1, 1]}, "rounds must be"),
    "rounds not a list": ({"rounds": "11"}, "rounds must be"),
    "rounds of floats": ({"rounds": [1.5, 1]}, "rounds must be"),
    "tokens_since_sync missing": ({"tokens_since_sync": None}, "tokens_since_sync must be"),
    "run_id too short": ({"run_id": "abcd"}, "run_id must be 40 lowercase hex"),
    "run_id a number": ({"run_id": 7}, "run_id must be"),
    "unknown format": ({"format": "2"}, "format must be"),
    "newer format": ({"format": 3}, "newer swarmstream.*upgrade swarmstream"),
    "adam step < 0": ({"adam_steps": {"0": -1}}, r"adam_steps\['0'\]"),
    "adam step NaN": ({"adam_steps": {"0": float("nan")}}, r"adam_steps\['0'\]"),
    "adam step of no parameter": ({"adam_steps": {"999": 4}}, r"adam_steps\['999'\]"),
    "adam steps missing one": ({"adam_steps": {"0": 4}}, "adam_steps does not name"),
    "sha256 missing": ({"sha256": None}, "sha256 must be"),
    "not an object": (None, "not a JSON object"),
}


@pytest.mark.parametrize("case", BAD_META, ids=list(BAD_META))
def test_out_of_range_metadata_is_refused_in_one_line_before_the_worker_changes(ckpt, case):
    shutil.rmtree(prev_path(ckpt))
    fields, reason = BAD_META[case]
    if fields is None:
        (ckpt / "meta.json").write_text("[1, 2]")
    else:
        m = {k: v for k, v in _meta(ckpt).items() if k not in fields or fields[k] is not None}
        m.update({k: v for k, v in fields.items() if v is not None})
        (ckpt / "meta.json").write_text(json.dumps(m))
    w, s = _fresh()
    snap = _snapshot(w)
    with pytest.raises(CheckpointError, match=reason) as e:
        load_checkpoint(ckpt, w, s, run_id=RUN)
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)
    assert _untouched(w, snap)


def test_when_both_checkpoints_are_bad_the_error_says_what_to_do_and_nothing_moves(ckpt):
    _flip_bit(ckpt)
    _rewrite(prev_path(ckpt), meta={"step": -5})
    before = _files(ckpt.parent)
    w, s = _fresh()
    snap = _snapshot(w)
    with pytest.raises(CheckpointError, match=r"damaged.*and so is the previous one .*step must be.*"
                                              r"move .*ckpt and .*ckpt\.prev aside") as e:
        load_checkpoint(ckpt, w, s, run_id=RUN)
    assert "\n" not in str(e.value) and _untouched(w, snap) and _files(ckpt.parent) == before
    assert not checkpoint_exists(ckpt.parent / "other")


def test_a_lone_previous_checkpoint_counts_as_a_checkpoint(ckpt):
    shutil.rmtree(ckpt)
    assert checkpoint_exists(ckpt)
    w, s = _fresh()
    assert load_checkpoint(ckpt, w, s, run_id=RUN) == [0, 1] and w.step == 2


def _poison_weight(w):
    next(w.model.parameters()).data.view(-1)[0] = float("nan")


def _poison_adam(w):
    w.opt.state[next(w.model.parameters())]["exp_avg"].view(-1)[0] = float("inf")


def _poison_global(w):
    w.outer[0].global_flat.view(-1)[1] = float("-inf")


def _poison_momentum(w):
    w.outer[1].opt.state[w.outer[1].global_flat]["momentum_buffer"].view(-1)[2] = float("nan")


@pytest.mark.parametrize("poison", [_poison_weight, _poison_adam, _poison_global, _poison_momentum],
                         ids=["weight", "adamw-moment", "global-copy", "outer-momentum"])
def test_a_non_finite_worker_is_never_saved_and_the_saved_checkpoints_stay(saved, ckpt, poison):
    w, s = copy.deepcopy(saved[0]), copy.deepcopy(saved[1])
    poison(w)
    before = _files(ckpt.parent)
    with pytest.raises(NonFiniteState, match="refusing to save .* holds NaN or inf; the saved checkpoint is kept") as e:
        save_checkpoint(ckpt, w, s, run_id=RUN, rounds=[2, 2])
    assert "\n" not in str(e.value) and _files(ckpt.parent) == before


def test_a_crash_between_any_two_steps_of_a_save_leaves_a_good_checkpoint(saved, ckpt):
    w, s = copy.deepcopy(saved[0]), copy.deepcopy(saved[1])
    train(w, s, 1)  # step 5: the save being interrupted
    template = ckpt.parent.parent / "template"
    shutil.copytree(ckpt.parent, template)
    # the staging copy written only in part, then after each step of the rotation
    for done in range(-1, len(checkpoint._ROTATION) + 1):
        shutil.rmtree(ckpt.parent)
        shutil.copytree(template, ckpt.parent)
        if done == -1:  # crashed while writing the staging copy: its meta.json is not there yet
            (ckpt.parent / "ckpt.tmp").mkdir()
            (ckpt.parent / "ckpt.tmp" / "tensors.safetensors").write_bytes(b"\0" * 64)
        else:
            checkpoint._write_staging(ckpt, *checkpoint._snapshot(ckpt, w, s, RUN, [1, 2]))
            for step in checkpoint._ROTATION[:done]:
                step(ckpt)
        assert checkpoint_exists(ckpt)
        fresh, sf = _fresh()
        load_checkpoint(ckpt, fresh, sf, run_id=RUN)
        # before the new one is in place: the last save's (4), or its previous one (2) if only
        # .prev is complete; after: the new one (5)
        expected = 5 if done >= 3 else 4
        assert fresh.step == expected, done
        # the next save cleans up whatever the crash left behind
        save_checkpoint(ckpt, fresh, sf, run_id=RUN, rounds=[1, 2])
        assert sorted(p.name for p in ckpt.parent.iterdir()) == ["ckpt", "ckpt.prev"], done


def test_a_format_1_checkpoint_without_a_checksum_still_loads_with_every_other_check(ckpt):
    shutil.rmtree(prev_path(ckpt))
    m = _meta(ckpt)
    del m["sha256"]
    m.update(format=1, adam_steps={k: float(v) for k, v in m["adam_steps"].items()})
    (ckpt / "meta.json").write_text(json.dumps(m))
    w, s = _fresh()
    assert load_checkpoint(ckpt, w, s, run_id=RUN) == [1, 1] and w.step == 4
    _nan_in_model(ckpt)
    with pytest.raises(CheckpointError, match="NaN or inf"):
        load_checkpoint(ckpt, *_fresh(), run_id=RUN)
