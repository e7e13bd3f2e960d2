"""Local checkpoints of a worker: everything needed to restart without losing what it trained.

A checkpoint is a folder with two files:

- ``tensors.safetensors``: ``model/<name>`` (local weights), ``adam/<i>/exp_avg`` and
  ``adam/<i>/exp_avg_sq`` (inner AdamW moments, by parameter index), ``global/<p>`` (fragment
  p's global fp32 copy), ``outer_momentum/<p>`` (its Nesterov buffer, if any), ``sampler``
  (the data order's RNG state);
- ``meta.json``: a format version, run ID, step, tokens, rounds per fragment, tokens since
  each fragment's last sync, AdamW step counts, and the SHA-256 of ``tensors.safetensors``.

Two checkpoints are kept: ``checkpoint`` (the latest) and ``checkpoint.prev`` (the one before).
A save never writes a non-finite model (it raises NonFiniteState and leaves the disk as it
was); otherwise it writes ``checkpoint.tmp`` completely and fsyncs it, then moves
``checkpoint.prev`` to ``checkpoint.trash``, ``checkpoint`` to ``checkpoint.prev``,
``checkpoint.tmp`` to ``checkpoint``, and deletes the trash. Each move is an atomic rename, so
a crash at any point leaves at least one complete checkpoint under one of the two names
(between the last two renames only ``.prev``: the loader then uses it, with a warning).
The cost of a save is one write and one read (the hash) of the tensors file.

Loading verifies the checksum, range-checks every field of meta.json, checks every tensor's
name, shape and dtype against the live worker and that it is finite, all before changing
anything. If the latest checkpoint fails, the previous one is used with a one-line warning and
the bad one is moved to ``checkpoint.bad`` (so the next save does not rotate it over the good
one); if both fail, CheckpointError says what to do. Format 1 checkpoints (before checksums)
still load, with every check but the checksum; the next save writes format 2.

Use ``checkpoint_exists(path)``, not ``path.exists()``: after an interrupted save only
``checkpoint.prev`` may be there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from peer.data import ShardSampler
from peer.worker import Worker
from protocol.messages import RUN_ID_BYTES

log = logging.getLogger(__name__)

FORMAT = 2
"""1: no checksum, no ``sha256``; 2: ``sha256`` of the tensors file, every field required."""
MAX_U64 = 2**63 - 1  # steps, tokens, AdamW steps: the wire's bound (protocol.messages.U64)
MAX_ROUND = 2**32 - 1  # rounds: the wire's bound (Heartbeat.rounds)
MAX_META_BYTES = 16 << 20  # a real meta.json is a few KiB (one AdamW step count per parameter)

TENSORS, META = "tensors.safetensors", "meta.json"


class CheckpointError(Exception):
    """The checkpoint cannot be used or written; the message says what to do."""


class NonFiniteState(CheckpointError):
    """The worker holds NaN or inf: saving it would replace a good checkpoint with a useless one."""


class _Unusable(Exception):
    """Why one checkpoint folder cannot be loaded (a reason, not yet a user-facing message)."""

    def __init__(self, reason: str, fix: str | None = None):
        super().__init__(reason)
        self.reason, self.fix = reason, fix


def prev_path(path: str | os.PathLike) -> Path:
    """Where the checkpoint before ``path``'s latest is kept."""
    path = Path(path)
    return path.with_name(path.name + ".prev")


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def checkpoint_exists(path: str | os.PathLike) -> bool:
    """True if there is a checkpoint to resume from at ``path`` (the latest or the previous one)."""
    return Path(path).exists() or prev_path(path).exists()


# --- what a checkpoint holds ------------------------------------------------------------------

def _tensors(worker: Worker, sampler: ShardSampler) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The tensors of a checkpoint, and AdamW's step count for each parameter it holds moments of."""
    out: dict[str, torch.Tensor] = {}
    weights, adam = worker.local_state()
    for name, t in weights.items():
        out[f"model/{name}"] = t
    for i, (_, exp_avg, exp_avg_sq) in adam.items():
        out[f"adam/{i}/exp_avg"] = exp_avg
        out[f"adam/{i}/exp_avg_sq"] = exp_avg_sq
    for f, frag in enumerate(worker.outer):
        out[f"global/{f}"] = frag.global_flat.detach()
        buf = frag.opt.state.get(frag.global_flat, {}).get("momentum_buffer")
        if buf is not None:
            out[f"outer_momentum/{f}"] = buf.detach()
    out["sampler"] = sampler.state()
    return {k: v.contiguous() for k, v in out.items()}, {str(i): int(step) for i, (step, _, _) in adam.items()}


def _layout(worker: Worker, sampler: ShardSampler) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]],
                                                             set[str]]:
    """Every tensor a checkpoint of ``worker`` may hold -> (shape, dtype), and those it must hold
    (the optimizers' state is absent before their first step). Copies nothing off the device."""
    spec: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    required: set[str] = set()
    for name, p in worker.model.named_parameters():
        spec[f"model/{name}"] = (tuple(p.shape), p.dtype)
        required.add(f"model/{name}")
    for i, p in enumerate(worker.model.parameters()):
        spec[f"adam/{i}/exp_avg"] = spec[f"adam/{i}/exp_avg_sq"] = (tuple(p.shape), p.dtype)
    for f, frag in enumerate(worker.outer):
        spec[f"global/{f}"] = spec[f"outer_momentum/{f}"] = (tuple(frag.global_flat.shape), frag.global_flat.dtype)
        required.add(f"global/{f}")
    st = sampler.state()
    spec["sampler"] = (tuple(st.shape), st.dtype)
    required.add("sampler")
    return spec, required


def _check_values(tensors: dict[str, torch.Tensor]) -> None:
    """Every float tensor finite, AdamW's second moments >= 0, the sampler state usable."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise _Unusable(f"{name} holds NaN or inf")
        if name.endswith("/exp_avg_sq") and bool((t < 0).any()):
            raise _Unusable(f"{name} is negative (AdamW's second moment cannot be)")
    if "sampler" in tensors:
        try:
            torch.Generator().set_state(tensors["sampler"])  # a scratch generator: the real one is untouched
        except RuntimeError as e:
            raise _Unusable(f"the sampler state is invalid ({e})") from None


def _is_int(v: object, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def _check_meta(meta: object, worker: Worker, adam_indices: set[int] | None) -> None:
    """Range-check meta.json. ``adam_indices``: the parameters whose AdamW moments the tensors
    file holds (format 2 must give each of them a step count), or None to skip that check."""
    if not isinstance(meta, dict):
        raise _Unusable("meta.json is not a JSON object")
    fmt = meta.get("format")
    if not _is_int(fmt, 1, FORMAT):
        if _is_int(fmt, FORMAT + 1, MAX_U64):
            raise _Unusable(f"it was written by a newer swarmstream (format {fmt})", "upgrade swarmstream")
        raise _Unusable(f"meta.json: format must be 1..{FORMAT}, got {fmt!r}")
    run = meta.get("run_id")
    if not (isinstance(run, str) and len(run) == 2 * RUN_ID_BYTES and all(c in "0123456789abcdef" for c in run)):
        raise _Unusable(f"meta.json: run_id must be {2 * RUN_ID_BYTES} lowercase hex digits, got {str(run)[:50]!r}")
    for key in ("step", "tokens"):
        if not _is_int(meta.get(key), 0, MAX_U64):
            raise _Unusable(f"meta.json: {key} must be an integer in 0..2**63-1, got {str(meta.get(key))[:30]}")
    n = len(worker.outer)
    rounds = meta.get("rounds")
    if not (isinstance(rounds, list) and len(rounds) == n and all(_is_int(r, 0, MAX_ROUND) for r in rounds)):
        raise _Unusable(f"meta.json: rounds must be {n} integers in 0..2**32-1, got {str(rounds)[:50]}")
    since = meta.get("tokens_since_sync", None if fmt >= 2 else [0] * n)
    if not (isinstance(since, list) and len(since) == n and all(_is_int(t, 0, MAX_U64) for t in since)):
        raise _Unusable(f"meta.json: tokens_since_sync must be {n} integers >= 0, got {str(since)[:50]}")
    adam = meta.get("adam_steps", None if fmt >= 2 else {})
    n_params = sum(1 for _ in worker.model.parameters())
    if not isinstance(adam, dict):
        raise _Unusable("meta.json: adam_steps must be an object")
    for k, v in adam.items():
        if not (k.isascii() and k.isdigit() and int(k) < n_params and type(v) in (int, float) and math.isfinite(v)
                and v == int(v) and 0 <= v <= MAX_U64):
            raise _Unusable(f"meta.json: adam_steps[{k[:20]!r}] must be a parameter index 0..{n_params - 1} "
                            f"mapped to a whole number >= 0, got {str(v)[:30]}")
    if fmt >= 2:
        if adam_indices is not None and {int(k) for k in adam} != adam_indices:
            raise _Unusable("meta.json: adam_steps does not name the parameters whose AdamW moments are saved")
        sha = meta.get("sha256")
        if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
            raise _Unusable(f"meta.json: sha256 must be 64 lowercase hex digits, got {str(sha)[:70]!r}")


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    with open(file, "rb") as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


# --- saving -----------------------------------------------------------------------------------

def save_checkpoint(path: str | os.PathLike, worker: Worker, sampler: ShardSampler, *, run_id: bytes,
                    rounds: list[int]) -> None:
    """Write the worker's state to ``path``, keeping the checkpoint it replaces as ``path.prev``.

    Raises NonFiniteState (and writes nothing) if any tensor is NaN or inf, CheckpointError if
    the counters are out of range; OSError if the disk fails (the saved checkpoints survive)."""
    path = Path(path)
    _write_staging(path, *_snapshot(path, worker, sampler, run_id, rounds))
    for step in _ROTATION:
        step(path)


def _snapshot(path: Path, worker: Worker, sampler: ShardSampler, run_id: bytes,
              rounds: list[int]) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and meta.json (less its checksum) of a checkpoint, checked as a load would."""
    tensors, adam_steps = _tensors(worker, sampler)
    try:
        _check_values(tensors)
    except _Unusable as e:
        kept = "the saved checkpoint is kept" if checkpoint_exists(path) else "nothing was saved"
        raise NonFiniteState(f"refusing to save a broken model at step {worker.step}: {e.reason}; {kept}") from None
    meta = {"format": FORMAT, "run_id": run_id.hex(), "step": worker.step, "tokens": worker.tokens,
            "rounds": list(rounds), "tokens_since_sync": list(worker.tokens_since_sync),
            "adam_steps": adam_steps, "sha256": "0" * 64}  # the real hash is of the file as written
    try:
        _check_meta(meta, worker, {int(k) for k in adam_steps})
    except _Unusable as e:
        raise CheckpointError(f"refusing to save checkpoint {path}: {e.reason}") from None
    return tensors, meta


def _fsync_dir(folder: Path) -> None:
    """Make renames and new files in ``folder`` durable (POSIX; Windows cannot open a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_staging(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Write the new checkpoint completely to ``path.tmp`` and fsync it; the saved ones are untouched."""
    tmp = _sibling(path, ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / TENSORS))
    meta = {**meta, "sha256": _sha256(tmp / TENSORS)}  # of the bytes on disk, as the loader will read them
    (tmp / META).write_text(json.dumps(meta))
    for f in (TENSORS, META):
        with open(tmp / f, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(tmp)


def _retire_prev(path: Path) -> None:
    """Move ``path.prev`` to the trash, if a latest checkpoint is about to take its place."""
    trash = _sibling(path, ".trash")
    shutil.rmtree(trash, ignore_errors=True)  # left by a save that crashed
    if path.exists() and prev_path(path).exists():
        prev_path(path).rename(trash)
        _fsync_dir(path.parent)


def _demote_latest(path: Path) -> None:
    """``path`` -> ``path.prev``. When ``path`` is absent (first save, an interrupted save, or the
    loader moved a bad one aside) ``path.prev`` stays: it is still the last good checkpoint."""
    if path.exists():
        path.rename(prev_path(path))
        _fsync_dir(path.parent)


def _promote_staging(path: Path) -> None:
    _sibling(path, ".tmp").rename(path)
    _fsync_dir(path.parent)


def _empty_trash(path: Path) -> None:
    shutil.rmtree(_sibling(path, ".trash"), ignore_errors=True)


_ROTATION = (_retire_prev, _demote_latest, _promote_staging, _empty_trash)
"""The steps of a save after the staging copy is written; a crash between any two leaves
``path`` or ``path.prev`` complete (tests run each prefix)."""


# --- loading ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Verified:
    meta: dict
    tensors: dict[str, torch.Tensor]


def _read(path: Path, worker: Worker, sampler: ShardSampler, run_id: bytes) -> _Verified:
    """Read and check one checkpoint folder without touching the worker; raises _Unusable."""
    if not path.exists():
        raise _Unusable("it is missing (a save was interrupted?)")
    try:
        with open(path / META, "rb") as fh:
            raw = fh.read(MAX_META_BYTES + 1)
        if len(raw) > MAX_META_BYTES:
            raise _Unusable(f"meta.json is over {MAX_META_BYTES} bytes")
        meta = json.loads(raw)
    except (OSError, ValueError, RecursionError) as e:
        raise _Unusable(f"it is unreadable ({type(e).__name__}: {str(e)[:80]})") from None
    _check_meta(meta, worker, None)
    if meta["run_id"] != run_id.hex():
        raise _Unusable("it belongs to another run", "use another --data-dir")
    try:
        if meta["format"] >= 2 and _sha256(path / TENSORS) != meta["sha256"]:
            raise _Unusable(f"{TENSORS} is damaged (its SHA-256 does not match meta.json)")
        tensors = load_file(str(path / TENSORS))
    except (OSError, SafetensorError) as e:
        raise _Unusable(f"it is unreadable ({type(e).__name__}: {str(e)[:80]})") from None
    spec, required = _layout(worker, sampler)
    missing, extra = required - tensors.keys(), tensors.keys() - spec.keys()
    if missing or extra:
        raise _Unusable(f"it does not match this model (missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]})")
    for k, v in tensors.items():
        if (tuple(v.shape), v.dtype) != spec[k]:
            raise _Unusable(f"it does not match this model: {k} is {v.dtype} {tuple(v.shape)}, expected "
                            f"{spec[k][1]} {spec[k][0]}")
    adam = {int(k.split("/")[1]) for k in tensors if k.startswith("adam/")}
    if any(f"adam/{i}/exp_avg" not in tensors or f"adam/{i}/exp_avg_sq" not in tensors for i in adam):
        raise _Unusable("it holds one of a parameter's two AdamW moments without the other")
    _check_meta(meta, worker, adam)
    _check_values(tensors)
    return _Verified(meta, tensors)


def load_checkpoint(path: str | os.PathLike, worker: Worker, sampler: ShardSampler, *, run_id: bytes) -> list[int]:
    """Restore ``worker`` and ``sampler`` from the checkpoint at ``path`` (or, if that one is
    unusable, from ``path.prev``, with a warning); returns the rounds per fragment.

    Raises CheckpointError, with the worker and sampler untouched, if neither can be used."""
    path = Path(path)
    prev = prev_path(path)
    try:
        ckpt = _read(path, worker, sampler, run_id)
    except _Unusable as bad:
        if not prev.exists():
            fix = bad.fix or f"move {path} aside to start this run fresh"
            raise CheckpointError(f"checkpoint {path} is unusable: {bad.reason}; {fix}") from None
        try:
            ckpt = _read(prev, worker, sampler, run_id)
        except _Unusable as bad_prev:
            fix = (bad.fix if bad.fix and bad.fix == bad_prev.fix
                   else f"move {path} and {prev} aside to start this run fresh")
            raise CheckpointError(f"checkpoint {path} is unusable ({bad.reason}) and so is the previous one "
                                  f"{prev} ({bad_prev.reason}); {fix}") from None
        kept = ""
        if path.exists():  # aside, so the next save does not rotate it over the good one
            aside = _sibling(path, ".bad")
            try:
                shutil.rmtree(aside, ignore_errors=True)
                path.rename(aside)
            except OSError as e:
                raise CheckpointError(f"checkpoint {path} is unusable ({bad.reason}) and cannot be moved aside "
                                      f"({e}); move it aside by hand") from None
            kept = f"moved it to {aside.name} and "
        log.warning("checkpoint path=%s is unusable (%s); %sresumed from the previous one path=%s step=%d",
                    path, bad.reason, kept, prev, ckpt.meta["step"])
        path = prev
    if ckpt.meta["format"] < 2:
        log.info("checkpoint path=%s is format %d: no checksum to verify, every other check passed; "
                 "the next save adds one", path, ckpt.meta["format"])
    _apply(ckpt, worker, sampler)
    return list(ckpt.meta["rounds"])


def _apply(ckpt: _Verified, worker: Worker, sampler: ShardSampler) -> None:
    """Everything is checked: now change the worker (nothing here can fail on the checkpoint's data)."""
    meta, tensors = ckpt.meta, ckpt.tensors
    names = [name for name, _ in worker.model.named_parameters()]
    # format 1 may lack a count: the run's step is the best guess
    worker.load_local_state({n: tensors[f"model/{n}"] for n in names},
                            {i: (float(meta["adam_steps"].get(str(i), meta["step"])), tensors[f"adam/{i}/exp_avg"],
                                 tensors[f"adam/{i}/exp_avg_sq"])
                             for i in range(len(names)) if f"adam/{i}/exp_avg" in tensors})
    with torch.no_grad():
        for f, frag in enumerate(worker.outer):
            frag.load(tensors[f"global/{f}"], tensors.get(f"outer_momentum/{f}"))
    sampler.set_state(tensors["sampler"])
    worker.step, worker.tokens = meta["step"], meta["tokens"]
    worker.tokens_since_sync = list(meta.get("tokens_since_sync", [0] * len(worker.outer)))
