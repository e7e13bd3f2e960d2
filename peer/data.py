"""Training text: a run's documents (``peer.sources``), a fixed held-out split, per-worker
shards and sample streams.

Tokens are raw bytes (vocab 256) unless the run names a Hugging Face ``tokenizers`` JSON
file. The held-out split is chosen per *document* by a hash of (seed, name), so it is the same
on every peer that has the same data, and no worker ever trains on it; it keeps the first
``HELDOUT_MAX_BYTES`` of held-out text in corpus order (the evaluation reads only its start).

A worker trains on its shard of the other documents (``DataConfig.shards``; 1: all of them),
at most ``DataConfig.max_shard_bytes`` of text, and draws training windows from it in its own
order, seeded by a hash of (seed, worker identity): workers see different samples without
coordinating, which is what a volunteer swarm of unknown size needs.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch

from peer.sources import (  # noqa: F401  (list_documents, stdlib_root: this module's API before peer.sources)
    DataError, Source, doc_shard, file_sha256, is_heldout, list_documents, shard_of, stdlib_root,
)
from protocol.config import DataConfig

log = logging.getLogger(__name__)

_DOC_SEPARATOR = b"\n\n"
HELDOUT_MAX_BYTES = 2 << 20
"""Held-out text kept, in corpus order: the evaluation reads its first eval_batches x batch x
(seq_len + 1) tokens (8 x 8 x 2049 at the 1b preset's context), and a streamed dataset need not
be read far to fill it (100 MB at a held-out fraction of 2%)."""


class Tokenizer:
    """Bytes -> token ids. Raw bytes by default; a ``tokenizers`` JSON file if given."""

    def __init__(self, path: str | None = None, sha256: str = ""):
        self._tok = None
        self.vocab_size = 256
        if path is not None:
            try:
                found = file_sha256(path)
            except OSError as e:
                raise DataError(f"cannot read tokenizer {path!r}: {e.strerror or e}") from None
            if sha256 and found != sha256:
                raise DataError(f"tokenizer {path!r} here is not the run's (sha256 {found[:12]}..., the run's "
                                f"{sha256[:12]}...); get the run's tokenizer file, then start again")
            try:
                from tokenizers import Tokenizer as HFTokenizer
            except ImportError:
                raise DataError("a tokenizer file needs the 'tokenizers' package: pip install 'swarmstream[hf]'") from None
            try:
                self._tok = HFTokenizer.from_file(path)
            except Exception as e:  # tokenizers raises its own untyped errors
                raise DataError(f"cannot load tokenizer {path!r}: {e}") from None
            self.vocab_size = self._tok.get_vocab_size()

    def encode(self, data: bytes) -> torch.Tensor:
        if self._tok is None:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int32)
        return torch.tensor(self._tok.encode(data.decode("utf-8", "replace")).ids, dtype=torch.int32)


@dataclass(slots=True)
class Corpus:
    """The token streams of one data source: ``train`` and ``heldout`` (1-D int32)."""

    train: torch.Tensor
    heldout: torch.Tensor
    n_train_docs: int
    n_heldout_docs: int


def load_corpus(cfg: DataConfig, vocab_size: int = 256, worker: str | bytes | None = None) -> Corpus:
    """Read the documents of ``cfg.source`` and split them into the held-out stream and the
    train stream of ``worker``'s shard (all shards without a worker). Raises DataError if the
    data or the tokenizer is not the run's (``cfg.fingerprint``, ``cfg.tokenizer_sha256``)."""
    tok = Tokenizer(cfg.tokenizer, cfg.tokenizer_sha256)
    if tok.vocab_size > vocab_size:
        raise DataError(f"tokenizer has {tok.vocab_size} tokens but model.vocab_size is {vocab_size}; "
                        "raise model.vocab_size")
    source = Source(cfg.source, cfg.text_field, cfg.fingerprint)
    dataset = source.kind.startswith("hf")
    if dataset:  # a dataset's fingerprint at once; local files' after the pass that reads them
        source.check()
    shard = shard_of(worker, cfg.seed, cfg.shards) if worker is not None and cfg.shards > 1 else None
    train_cap = cfg.max_shard_bytes or float("inf")
    train, held = bytearray(), bytearray()
    n_train = n_held = 0
    log.info("reading data source=%s shard=%s", cfg.source, "all" if shard is None else f"{shard}/{cfg.shards}")
    for name, text in source.documents():
        if is_heldout(name, cfg.seed, cfg.heldout_fraction):
            if len(held) < HELDOUT_MAX_BYTES:
                held += text + _DOC_SEPARATOR
                n_held += 1
        elif (shard is None or doc_shard(name, cfg.seed, cfg.shards) == shard) and len(train) < train_cap:
            train += text + _DOC_SEPARATOR
            n_train += 1
        if dataset and len(train) >= train_cap and len(held) >= HELDOUT_MAX_BYTES:
            break
    if not dataset:  # local files are read whole, to check them
        source.check()
    where = "" if shard is None else f" in shard {shard} of {cfg.shards}"
    if n_held == 0 or n_train == 0:
        raise DataError(f"data source {cfg.source!r} is too small to split: {n_train} train documents{where} and "
                        f"{n_held} held-out; add documents, raise data.heldout_fraction or lower data.shards")
    log.info("corpus source=%s shard=%s train_docs=%d train_bytes=%d heldout_docs=%d heldout_bytes=%d",
             cfg.source, "all" if shard is None else f"{shard}/{cfg.shards}", n_train, len(train), n_held, len(held))
    return Corpus(tok.encode(bytes(train)), tok.encode(bytes(held)), n_train, n_held)


def worker_seed(seed: int, worker: str | bytes) -> int:
    """A 63-bit seed for ``worker``'s sample order, derived from the run seed and its identity."""
    w = worker.encode() if isinstance(worker, str) else worker
    return int.from_bytes(hashlib.blake2b(seed.to_bytes(8, "little") + w, digest_size=8).digest(), "little") >> 1


class ShardSampler:
    """Random training windows for one worker: ``next_batch()`` -> (x, y), each (B, T) int64."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int, worker: str | bytes):
        if tokens.numel() < seq_len + 2:
            raise DataError(f"train split has {tokens.numel()} tokens, fewer than one sequence of {seq_len}")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.gen = torch.Generator().manual_seed(worker_seed(seed, worker))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.seq_len
        starts = torch.randint(0, self.tokens.numel() - T - 1, (self.batch_size,), generator=self.gen)
        idx = starts[:, None] + torch.arange(T + 1)  # (B, T+1)
        win = self.tokens[idx].long()
        return win[:, :-1], win[:, 1:]

    def state(self) -> torch.Tensor:
        """The generator state, to checkpoint and restore the sample order exactly."""
        return self.gen.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.gen.set_state(state)


def heldout_batches(tokens: torch.Tensor, seq_len: int, batch_size: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``n_batches`` batches of non-overlapping windows of the held-out stream: the
    same on every peer, so held-out losses are comparable across peers and runs."""
    per = seq_len + 1
    n_win = min(tokens.numel() // per, n_batches * batch_size)
    if n_win == 0:
        raise DataError(f"held-out split has {tokens.numel()} tokens, fewer than one sequence of {seq_len}")
    win = tokens[: n_win * per].view(n_win, per).long()
    return [(b[:, :-1], b[:, 1:]) for b in win.split(batch_size)]
