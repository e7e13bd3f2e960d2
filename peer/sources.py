"""Where a run's documents come from, which of them each worker reads, and the fingerprint that
shows two peers read the same data.

Sources (``DataConfig.source``):

- ``stdlib``: the running Python's standard library ``.py`` files (demos; not fingerprinted,
  since it differs between Python versions);
- a file, a folder or a glob: each text file is a document, and each line of a ``.jsonl`` file
  is one (the string in its ``text_field``), named ``<file>#<line>``;
- ``hf:FOLDER``: a Hugging Face dataset saved with ``datasets``' ``save_to_disk`` (its
  ``train`` split if it holds several); ``hf:NAME[:CONFIG]``: one on the hub, streamed, never
  whole on disk or in memory. Row i is the document named ``i``.

Documents come in corpus order, the same on every peer with the same data. Each is held out
or dealt into one of ``shards`` shards by a hash of its name and the run seed; a worker reads
the shard that a hash of its identity and the seed picks (``shard_of``).

The fingerprint (``Source.fingerprint``), computed by ``run new`` and kept in the manifest, is
checked by every worker before it trains: for local files, a SHA-256 over every document file's
name and content; for a saved dataset, the fingerprint ``datasets`` keeps with it; for the hub,
the dataset's commit, which then pins the revision every worker streams.

No torch here: ``run new`` imports this module.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

HF_PREFIX = "hf:"


class DataError(Exception):
    """The data source cannot be used; the message says what to change."""


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_documents(source: str) -> list[tuple[str, Path]]:
    """(name, path) of every file of a local ``source``, sorted by name: the corpus order."""
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
        raise DataError(f"data source {source!r} has no files; give a file, a folder, a glob, 'stdlib' or hf:NAME")
    return docs


def _unit(seed: int, *parts: str | bytes) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(str(seed).encode())
    for p in parts:
        h.update(b"\0" + (p.encode() if isinstance(p, str) else p))
    return int.from_bytes(h.digest(), "little")


def is_heldout(name: str, seed: int, fraction: float) -> bool:
    h = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64 < fraction


def doc_shard(name: str, seed: int, shards: int) -> int:
    """The shard a training document is dealt into."""
    return _unit(seed, "doc", name) % shards


def shard_of(worker: str | bytes, seed: int, shards: int) -> int:
    """The shard a worker reads: from its identity (public key) and the run seed."""
    return _unit(seed, "worker", worker) % shards


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


class Source:
    """One ``DataConfig.source``. ``documents()`` yields (name, text) in corpus order; after a
    whole pass over a local source, ``read_fingerprint`` is the fingerprint of what it read."""

    def __init__(self, source: str, text_field: str = "text", pinned: str = ""):
        self.source, self.text_field, self.pinned = source, text_field, pinned
        self.read_fingerprint = ""
        if source == "stdlib":
            self.kind = "stdlib"
        elif source.startswith(HF_PREFIX):
            rest = source[len(HF_PREFIX):]
            if not rest:
                raise DataError("data source 'hf:' names no dataset; give hf:NAME[:CONFIG] or hf:FOLDER")
            if os.path.isdir(os.path.expanduser(rest)):
                self.kind, self.path = "hf-disk", os.path.expanduser(rest)
            elif rest.startswith(("/", ".", "~")):
                raise DataError(f"no dataset folder at {rest!r} (data source {source!r}); save one there with "
                                "datasets' save_to_disk, or give hf:NAME for one on the hub")
            else:
                self.kind = "hf-hub"
                self.name, _, config = rest.partition(":")
                self.config = config or None
        else:
            self.kind = "local"

    # --- the fingerprint ----------------------------------------------------------------------

    def fingerprint(self) -> str:
        """What ``run new`` records: reads every local file once; asks the hub for the commit."""
        if self.kind == "stdlib":
            return ""
        if self.kind == "local":
            for _ in self.documents():
                pass
            return self.read_fingerprint
        if self.kind == "hf-disk":
            return "hf-disk:" + self._disk_fingerprint(self._disk())
        try:
            from huggingface_hub import HfApi
        except ImportError:
            raise DataError("an hf: data source needs the 'datasets' package: pip install 'swarmstream[hf]'") from None
        try:
            sha = HfApi().dataset_info(self.name).sha
        except Exception as e:  # noqa: BLE001  (network, not found, gated: all one line for the user)
            raise DataError(f"cannot look up dataset {self.name!r} on the Hugging Face hub: {e}") from None
        return f"hf-hub:{self.name}:{self.config or ''}@{sha}"

    def check(self) -> None:
        """After a whole pass over a local source, or at once for a dataset: raise if what we
        read is not what the run's fingerprint (``pinned``) says. Nothing to check if unset."""
        if not self.pinned:
            return
        if self.kind == "hf-disk":
            self.read_fingerprint = "hf-disk:" + self._disk_fingerprint(self._disk())
        elif self.kind == "hf-hub":
            self.read_fingerprint = self.pinned if self.pinned.startswith(f"hf-hub:{self.name}:") else "another dataset"
        if self.read_fingerprint != self.pinned:
            raise DataError(f"data source {self.source!r} here is not the run's data (fingerprint "
                            f"{self.read_fingerprint[:40] or 'none'}, the run's {self.pinned[:40]}); "
                            "get the same files or dataset the run was created with, then start again")

    # --- the documents ------------------------------------------------------------------------

    def documents(self) -> Iterator[tuple[str, bytes]]:
        if self.kind in ("stdlib", "local"):
            return self._local()
        return self._rows(self._disk() if self.kind == "hf-disk" else self._hub())

    def _local(self) -> Iterator[tuple[str, bytes]]:
        h = hashlib.sha256()
        for name, path in list_documents(self.source):
            try:
                data = path.read_bytes()
            except OSError as e:
                log.warning("skipping unreadable document path=%s reason=%s", path, e)
                continue
            h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
            if path.suffix == ".jsonl":
                yield from self._jsonl(name, data)
            else:
                yield name, data
        self.read_fingerprint = "" if self.kind == "stdlib" else "files:" + h.hexdigest()

    def _jsonl(self, name: str, data: bytes) -> Iterator[tuple[str, bytes]]:
        for n, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                text = row[self.text_field]
            except (ValueError, TypeError, KeyError):
                text = None
            if not isinstance(text, str):
                raise DataError(f"{name} line {n} is not a JSON object with a string field {self.text_field!r}; "
                                "fix the line or set data.text_field (run new --text-field)")
            yield f"{name}#{n}", text.encode()

    def _rows(self, dataset: Any) -> Iterator[tuple[str, bytes]]:
        for i, row in enumerate(dataset):
            text = row.get(self.text_field) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise DataError(f"row {i} of {self.source!r} has no string field {self.text_field!r}; "
                                f"its fields are {sorted(row) if isinstance(row, dict) else '?'}: set data.text_field")
            yield str(i), text.encode()

    def _datasets(self) -> Any:
        try:
            import datasets
        except ImportError:
            raise DataError("an hf: data source needs the 'datasets' package: pip install 'swarmstream[hf]'") from None
        datasets.disable_progress_bars()
        return datasets

    def _disk(self) -> Any:
        datasets = self._datasets()
        try:
            ds = datasets.load_from_disk(self.path)
        except Exception as e:  # noqa: BLE001  (datasets raises many kinds for a folder it cannot read)
            raise DataError(f"cannot read the dataset saved at {self.path!r}: {e}") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DataError(f"the dataset at {self.path!r} has splits {sorted(ds)} and no 'train'; "
                                "save the split to train on alone, or as 'train'")
            ds = ds["train"]
        return ds

    @staticmethod
    def _disk_fingerprint(ds: Any) -> str:
        fp = getattr(ds, "_fingerprint", None)
        if not isinstance(fp, str) or not fp:
            raise DataError("the saved dataset has no fingerprint; save it again with datasets' save_to_disk")
        return fp

    def _hub(self) -> Any:
        datasets = self._datasets()
        revision = self.pinned.rpartition("@")[2] if self.pinned.startswith("hf-hub:") else None
        try:
            return datasets.load_dataset(self.name, self.config, split="train", streaming=True, revision=revision)
        except Exception as e:  # noqa: BLE001
            raise DataError(f"cannot stream dataset {self.name!r} from the Hugging Face hub: {e}") from None
