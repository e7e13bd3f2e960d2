"""Training text: documents from a source, a fixed held-out split, per-worker sample streams.

Tokens are raw bytes (vocab 256) unless the run names a Hugging Face ``tokenizers`` JSON
file. The held-out split is chosen per *document* by a hash of (seed, relative path), so it
is the same on every peer that has the same files, and no worker ever trains on it.

Each worker draws training windows in its own order, seeded by a hash of (seed, worker
identity): workers see different samples of the same train split without coordinating,
which is what a volunteer swarm of unknown size needs. (A disjoint partition would require
knowing the other workers; with random windows over tens of MB the overlap is negligible.)
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from protocol.config import DataConfig

log = logging.getLogger(__name__)

_DOC_SEPARATOR = b"\n\n"


class DataError(Exception):
    """The data source cannot be used; the message says what to change."""


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_documents(source: str) -> list[tuple[str, Path]]:
    """(name, path) of every document of ``source``, sorted by name: the corpus order."""
    if source == "stdlib":
        root = stdlib_root()
        paths = [p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts]
    else:
        src = Path(os.path.expanduser(source))
        if src.is_file():
            root, paths = src.parent, [src]
        elif src.is_dir():
            root, paths = src, [p for p in src.rglob("*") if p.is_file()]
        else:
            root = Path(".")
            paths = [Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True) if os.path.isfile(p)]
    docs = sorted((p.relative_to(root).as_posix() if p.is_relative_to(root) else p.as_posix(), p) for p in paths)
    if not docs:
        raise DataError(f"data source {source!r} has no files; give a file, a folder, a glob, or 'stdlib'")
    return docs


def is_heldout(name: str, seed: int, fraction: float) -> bool:
    h = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64 < fraction


class Tokenizer:
    """Bytes -> token ids. Raw bytes by default; a ``tokenizers`` JSON file if given."""

    def __init__(self, path: str | None = None):
        self._tok = None
        self.vocab_size = 256
        if path is not None:
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


def load_corpus(cfg: DataConfig, vocab_size: int = 256) -> Corpus:
    """Read every document of ``cfg.source`` and split it into train and held-out streams."""
    tok = Tokenizer(cfg.tokenizer)
    if tok.vocab_size > vocab_size:
        raise DataError(f"tokenizer has {tok.vocab_size} tokens but model.vocab_size is {vocab_size}; "
                        "raise model.vocab_size")
    train, held = bytearray(), bytearray()
    n_train = n_held = 0
    for name, path in list_documents(cfg.source):
        try:
            text = path.read_bytes()
        except OSError as e:
            log.warning("skipping unreadable document path=%s reason=%s", path, e)
            continue
        if is_heldout(name, cfg.seed, cfg.heldout_fraction):
            held += text + _DOC_SEPARATOR
            n_held += 1
        else:
            train += text + _DOC_SEPARATOR
            n_train += 1
    if n_held == 0 or n_train == 0:
        raise DataError(f"data source {cfg.source!r} is too small to split: {n_train} train and {n_held} "
                        f"held-out documents; add files or raise data.heldout_fraction")
    log.info("corpus source=%s train_docs=%d train_bytes=%d heldout_docs=%d heldout_bytes=%d",
             cfg.source, n_train, len(train), n_held, len(held))
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
