import pytest
import torch

from peer.data import (DataError, ShardSampler, heldout_batches, is_heldout, list_documents, load_corpus,
                       worker_seed)
from protocol.config import DataConfig


@pytest.fixture
def folder(tmp_path):
    for i in range(60):
        (tmp_path / f"doc{i:02d}.txt").write_bytes(f"document {i} ".encode() * 20)
    return tmp_path


def test_stdlib_is_the_default_and_lists_python_files_in_sorted_order():
    docs = list_documents("stdlib")
    names = [n for n, _ in docs]
    assert len(docs) > 500 and all(n.endswith(".py") for n in names)
    assert names == sorted(names)
    assert not any(n.startswith("site-packages/") for n in names)


def test_folder_file_and_glob_sources(folder):
    assert len(list_documents(str(folder))) == 60
    assert len(list_documents(str(folder / "doc01.txt"))) == 1
    assert len(list_documents(str(folder / "doc1*.txt"))) == 10
    with pytest.raises(DataError, match="no files"):
        list_documents(str(folder / "nothing-*.md"))


def test_heldout_split_is_deterministic_disjoint_and_seeded(folder):
    cfg = DataConfig(source=str(folder), heldout_fraction=0.2, seed=3)
    a, b = load_corpus(cfg), load_corpus(cfg)
    assert torch.equal(a.train, b.train) and torch.equal(a.heldout, b.heldout)
    assert a.n_train_docs + a.n_heldout_docs == 60 and 3 <= a.n_heldout_docs <= 25
    held = {f"doc{i:02d}.txt" for i in range(60) if is_heldout(f"doc{i:02d}.txt", 3, 0.2)}
    text = bytes(a.train.to(torch.uint8).tolist())
    for name in held:  # no held-out document appears in the train stream
        assert f"document {int(name[3:5])} ".encode() not in text
    other = {f"doc{i:02d}.txt" for i in range(60) if is_heldout(f"doc{i:02d}.txt", 4, 0.2)}
    assert held != other


def test_too_small_source_is_refused_with_advice(tmp_path):
    (tmp_path / "one.txt").write_text("x" * 1000)
    with pytest.raises(DataError, match="too small"):
        load_corpus(DataConfig(source=str(tmp_path)))


def test_worker_samples_are_deterministic_per_identity_and_differ_across_workers():
    tokens = torch.arange(10_000, dtype=torch.int32) % 256
    a1 = ShardSampler(tokens, 16, 4, seed=0, worker="alice").next_batch()
    a2 = ShardSampler(tokens, 16, 4, seed=0, worker="alice").next_batch()
    b = ShardSampler(tokens, 16, 4, seed=0, worker="bob").next_batch()
    assert torch.equal(a1[0], a2[0]) and not torch.equal(a1[0], b[0])
    x, y = a1
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert worker_seed(0, "alice") != worker_seed(1, "alice")


def test_sampler_state_restores_the_exact_sample_order():
    tokens = torch.arange(10_000, dtype=torch.int32) % 256
    s = ShardSampler(tokens, 16, 4, seed=0, worker="w")
    s.next_batch()
    state = s.state()
    nxt = s.next_batch()
    s.set_state(state)
    assert torch.equal(s.next_batch()[0], nxt[0])


def test_heldout_batches_are_fixed_non_overlapping_windows():
    tokens = torch.arange(1000, dtype=torch.int32)
    batches = heldout_batches(tokens, seq_len=9, batch_size=4, n_batches=3)
    assert len(batches) == 3
    x0, y0 = batches[0]
    assert x0[0].tolist() == list(range(9)) and y0[0].tolist() == list(range(1, 10))
    assert x0[1, 0].item() == 10
