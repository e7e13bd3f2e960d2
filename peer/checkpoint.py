"""Local checkpoints of a worker: everything needed to restart without losing what it trained.

A checkpoint is a folder with two files, written to a temporary folder and renamed into
place, so a crash mid-write leaves the previous checkpoint intact:

- ``tensors.safetensors``: ``model/<name>`` (local weights), ``adam/<i>/exp_avg`` and
  ``adam/<i>/exp_avg_sq`` (inner AdamW moments, by parameter index), ``global/<p>`` (fragment
  p's global fp32 copy), ``outer_momentum/<p>`` (its Nesterov buffer, if any), ``sampler``
  (the data order's RNG state);
- ``meta.json``: run ID, step, tokens, rounds per fragment, AdamW step counts, a format version.

Loading checks the run ID and every tensor's name, shape and dtype against the live worker
before changing anything; a mismatch raises CheckpointError and the worker is left as it was.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from peer.data import ShardSampler
from peer.worker import Worker

FORMAT = 1


class CheckpointError(Exception):
    """The checkpoint cannot be used; the message says what to do."""


def _tensors(worker: Worker, sampler: ShardSampler) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, p in worker.model.named_parameters():
        out[f"model/{name}"] = p.detach().cpu()
    for i, p in enumerate(worker.model.parameters()):
        st = worker.opt.state.get(p, {})
        if "exp_avg" in st:
            out[f"adam/{i}/exp_avg"] = st["exp_avg"].detach().cpu()
            out[f"adam/{i}/exp_avg_sq"] = st["exp_avg_sq"].detach().cpu()
    for f, frag in enumerate(worker.outer):
        out[f"global/{f}"] = frag.global_flat.detach()
        buf = frag.opt.state.get(frag.global_flat, {}).get("momentum_buffer")
        if buf is not None:
            out[f"outer_momentum/{f}"] = buf.detach()
    out["sampler"] = sampler.state()
    return {k: v.contiguous() for k, v in out.items()}


def save_checkpoint(path: str | os.PathLike, worker: Worker, sampler: ShardSampler, *, run_id: bytes,
                    rounds: list[int]) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(_tensors(worker, sampler), str(tmp / "tensors.safetensors"))
    adam_steps = {str(i): float(worker.opt.state[p]["step"]) for i, p in enumerate(worker.model.parameters())
                  if p in worker.opt.state and "step" in worker.opt.state[p]}
    meta = {"format": FORMAT, "run_id": run_id.hex(), "step": worker.step, "tokens": worker.tokens,
            "rounds": list(rounds), "tokens_since_sync": list(worker.tokens_since_sync), "adam_steps": adam_steps}
    (tmp / "meta.json").write_text(json.dumps(meta))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: str | os.PathLike, worker: Worker, sampler: ShardSampler, *, run_id: bytes) -> list[int]:
    """Restore ``worker`` and ``sampler`` from ``path``; returns the rounds per fragment."""
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
        tensors = load_file(str(path / "tensors.safetensors"))
    except (OSError, ValueError, SafetensorError) as e:
        raise CheckpointError(f"checkpoint {path} is unreadable ({e}); move it away to start fresh") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has an unknown format; move it away to start fresh")
    if meta.get("run_id") != run_id.hex():
        raise CheckpointError(f"checkpoint {path} belongs to another run; use another --data-dir")
    expected = _tensors(worker, sampler)
    needed = {k for k in expected if not k.startswith(("adam/", "outer_momentum/"))}
    missing = needed - tensors.keys()
    extra = tensors.keys() - expected.keys() - {k for k in tensors if k.startswith(("adam/", "outer_momentum/"))}
    if missing or extra:
        raise CheckpointError(f"checkpoint {path} does not match this model (missing {sorted(missing)[:3]}, "
                              f"unexpected {sorted(extra)[:3]}); move it away to start fresh")
    for k, v in tensors.items():
        if k in expected and (v.shape != expected[k].shape or v.dtype != expected[k].dtype):
            raise CheckpointError(f"checkpoint {path}: {k} has shape {tuple(v.shape)}, expected "
                                  f"{tuple(expected[k].shape)}; move it away to start fresh")
    rounds = meta.get("rounds")
    if not (isinstance(rounds, list) and len(rounds) == len(worker.outer) and all(isinstance(r, int) for r in rounds)):
        raise CheckpointError(f"checkpoint {path} has bad round counters; move it away to start fresh")
    # everything checked: now change the worker
    params = list(worker.model.parameters())
    with torch.no_grad():
        for name, p in worker.model.named_parameters():
            p.copy_(tensors[f"model/{name}"])
        for i, p in enumerate(params):
            if f"adam/{i}/exp_avg" in tensors:
                worker.opt.state[p] = {
                    "step": torch.tensor(float(meta["adam_steps"].get(str(i), worker.step))),
                    "exp_avg": tensors[f"adam/{i}/exp_avg"].to(p.device),
                    "exp_avg_sq": tensors[f"adam/{i}/exp_avg_sq"].to(p.device)}
        for f, frag in enumerate(worker.outer):
            frag.global_flat.copy_(tensors[f"global/{f}"])
            if f"outer_momentum/{f}" in tensors:
                frag.opt.state[frag.global_flat] = {"momentum_buffer": tensors[f"outer_momentum/{f}"].clone()}
    sampler.set_state(tensors["sampler"])
    worker.step, worker.tokens = int(meta["step"]), int(meta["tokens"])
    worker.tokens_since_sync = [int(t) for t in meta.get("tokens_since_sync", [0] * len(worker.outer))]
    return [int(r) for r in rounds]
