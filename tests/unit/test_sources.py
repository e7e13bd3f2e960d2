"""Data sources beyond one folder of text: .jsonl files, datasets saved with ``datasets``, the
shard each worker reads, and the fingerprint and tokenizer hash a worker checks at start."""

import json

import pytest
import torch

from peer.data import DataError, load_corpus
from peer.sources import Source, doc_shard, shard_of
from protocol.config import DataConfig


def texts(n: int, tag: str = "doc") -> list[str]:
    return [f"{tag} number {i}: " + "the quick brown fox jumps over the lazy dog. " * (5 + i % 7) for i in range(n)]


def decoded(t: torch.Tensor) -> str:
    return bytes(t.to(torch.uint8).tolist()).decode()


def docs_in(stream: torch.Tensor, all_texts: list[str]) -> set[int]:
    s = decoded(stream)
    return {i for i, t in enumerate(all_texts) if t in s}


@pytest.fixture
def saved(tmp_path):
    import datasets  # the test install has the hf extra

    rows = texts(200)
    path = tmp_path / "ds"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": rows, "n": list(range(200))})}).save_to_disk(path)
    return path, rows


def test_jsonl_lines_are_documents_and_a_bad_line_is_named(tmp_path):
    rows = texts(80)
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(rows)) + "\n\n")
    (tmp_path / "b.txt").write_text("plain text document " * 50)
    docs = list(Source(str(tmp_path)).documents())
    assert [n for n, _ in docs[:2]] == ["a.jsonl#1", "a.jsonl#2"] and docs[-1][0] == "b.txt"
    assert [t.decode() for _, t in docs[:80]] == rows
    (tmp_path / "c.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError, match=r"c.jsonl line 2 .*'text'"):
        list(Source(str(tmp_path)).documents())


def test_shards_deal_every_training_document_to_exactly_one_worker_shard(tmp_path):
    rows = texts(300)
    (tmp_path / "all.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in rows))
    cfg = DataConfig(source=str(tmp_path), shards=3, heldout_fraction=0.1, seed=5)
    workers = {}
    for w in range(40):  # enough identities to hit every shard
        workers.setdefault(shard_of(f"worker-{w}".encode(), 5, 3), f"worker-{w}".encode())
    assert sorted(workers) == [0, 1, 2]
    corpora = {k: load_corpus(cfg, worker=w) for k, w in workers.items()}
    train = {k: docs_in(c.train, rows) for k, c in corpora.items()}
    held = docs_in(corpora[0].heldout, rows)
    assert all(torch.equal(c.heldout, corpora[0].heldout) for c in corpora.values())  # one held-out set
    assert not (train[0] & train[1]) and not (train[0] & train[2]) and not (train[1] & train[2])
    assert train[0] | train[1] | train[2] | held == set(range(300)) and not (held & (train[0] | train[1] | train[2]))
    for k in range(3):  # each shard holds what the hash deals it
        assert train[k] == {i for i in range(300) if i not in held and doc_shard(f"all.jsonl#{i + 1}", 5, 3) == k}
    everything = load_corpus(cfg)  # no worker: all shards (the simulation, the benches)
    assert docs_in(everything.train, rows) == train[0] | train[1] | train[2]
    capped = load_corpus(DataConfig(source=str(tmp_path), shards=3, seed=5, heldout_fraction=0.1, max_shard_bytes=2000),
                         worker=workers[1])
    assert 0 < capped.n_train_docs < corpora[1].n_train_docs and capped.train.numel() < 2000 + 600


def test_a_local_fingerprint_follows_the_content_and_refuses_other_data(tmp_path):
    (tmp_path / "d").mkdir()
    for i, t in enumerate(texts(60)):
        (tmp_path / "d" / f"{i:02d}.txt").write_text(t)
    fp = Source(str(tmp_path / "d")).fingerprint()
    assert fp.startswith("files:") and fp == Source(str(tmp_path / "d")).fingerprint()
    assert Source("stdlib").fingerprint() == ""  # differs between Python versions: not checked
    cfg = DataConfig(source=str(tmp_path / "d"), fingerprint=fp, heldout_fraction=0.1)
    assert load_corpus(cfg).n_train_docs > 0
    (tmp_path / "d" / "07.txt").write_text("another text " * 30)
    with pytest.raises(DataError, match="not the run's data") as e:
        load_corpus(cfg)
    assert "\n" not in str(e.value)


def test_a_tokenizer_other_than_the_runs_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1, "fox": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tok.json"
    tok.save(str(path))
    from peer.sources import file_sha256

    (tmp_path / "d").mkdir()
    for i, t in enumerate(texts(60)):
        (tmp_path / "d" / f"{i:02d}.txt").write_text(t)
    cfg = DataConfig(source=str(tmp_path / "d"), tokenizer=str(path), tokenizer_sha256=file_sha256(path),
                     heldout_fraction=0.1)
    assert set(load_corpus(cfg).train.unique().tolist()) <= {0, 1, 2}
    tok.add_tokens(["dog"])
    tok.save(str(path))
    with pytest.raises(DataError, match="not the run's"):
        load_corpus(cfg)


def test_a_saved_dataset_is_sharded_fingerprinted_and_checked(saved, tmp_path):
    path, rows = saved
    fp = Source(f"hf:{path}").fingerprint()
    assert fp.startswith("hf-disk:") and fp == Source(f"hf:{path}").fingerprint()
    cfg = DataConfig(source=f"hf:{path}", shards=2, heldout_fraction=0.1, seed=1, fingerprint=fp)
    by_shard = {}
    for w in range(20):
        by_shard.setdefault(shard_of(f"w{w}".encode(), 1, 2), f"w{w}".encode())
    a, b = (load_corpus(cfg, worker=by_shard[k]) for k in (0, 1))
    ta, tb, held = docs_in(a.train, rows), docs_in(b.train, rows), docs_in(a.heldout, rows)
    assert ta and tb and held and not (ta & tb) and ta | tb | held == set(range(200))
    assert torch.equal(a.heldout, b.heldout)

    import datasets

    datasets.Dataset.from_dict({"text": texts(200, "other")}).save_to_disk(tmp_path / "other")
    with pytest.raises(DataError, match="not the run's data"):
        load_corpus(DataConfig(source=f"hf:{tmp_path / 'other'}", heldout_fraction=0.1, fingerprint=fp))
    with pytest.raises(DataError, match="no string field 'body'"):
        load_corpus(DataConfig(source=f"hf:{path}", heldout_fraction=0.1, text_field="body"))
    with pytest.raises(DataError, match="cannot read the dataset"):
        (tmp_path / "empty").mkdir()
        Source(f"hf:{tmp_path / 'empty'}").fingerprint()


def test_data_settings_are_validated():
    from protocol.errors import ConfigError

    for bad in ({"shards": 0}, {"max_shard_bytes": -1}, {"text_field": ""}, {"tokenizer_sha256": "xyz"},
                {"tokenizer_sha256": "a" * 64}, {"fingerprint": "a\nb"}):
        with pytest.raises(ConfigError):
            DataConfig(**bad)
