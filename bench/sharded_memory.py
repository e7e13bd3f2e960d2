"""What one process of a multi-device node holds, DDP against FSDP (``peer.node --sharding``).

Starts the worker of a node with ``--gpus N`` the way the node does (``torch.distributed.run``,
N processes; gloo on CPU, nccl on CUDA), trains a few inner steps and one outer step (every
fragment's pseudo-gradient gathered to rank 0, outer step, merge scattered back), and reports
for each process:
- the training state it holds on its device: weights, gradients (as big as the weights, at the
  backward) and AdamW moments, counted from the tensors themselves (its own shards under FSDP);
- its peak resident memory (``ru_maxrss``), which on CPU also holds the device's tensors, and on
  rank 0 the fp32 global copies and outer momentum;
- on CUDA, its peak allocated GPU memory.

    python bench/sharded_memory.py --preset 150m --procs 2 --seq-len 128
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchutil import print_table, write_json  # noqa: E402

from protocol.config import InnerConfig, SyncConfig, TrainConfig, model_preset  # noqa: E402

MIB = 1 << 20


def _config(args) -> TrainConfig:
    model = dataclasses.replace(model_preset(args.preset), seq_len=args.seq_len)
    return TrainConfig(model=model, inner=InnerConfig(batch_size=args.procs * args.rows, warmup_steps=2),
                       sync=SyncConfig(inner_steps=args.steps, fragments=2, overlap=0))


def _state_bytes(worker) -> int:
    """Bytes of weights, gradients and AdamW moments this process holds (its shards under FSDP)."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in worker.model.parameters():
        total += 2 * local(p).numel() * p.element_size()  # the weights, and their gradients at the backward
        for k in ("exp_avg", "exp_avg_sq"):
            t = worker.opt.state.get(p, {}).get(k)
            if t is not None:
                total += local(t).numel() * t.element_size()
    return total


def _process(args) -> None:
    """One process of the node (under torchrun)."""
    import torch
    import torch.distributed as dist

    from peer.node import replicas

    torch.set_num_threads(1)
    device = torch.device(args.device)
    replicas.init_group(replicas.local_device(device))
    device = replicas.local_device(device)
    train = _config(args)
    worker = replicas.worker_class(args.sharding == "fsdp")(train, device=device)
    t0 = time.perf_counter()
    if worker.rank == 0:
        g = torch.Generator().manual_seed(0)
        for _ in range(args.steps):
            w = torch.randint(0, train.model.vocab_size, (train.inner.batch_size, train.model.seq_len + 1), generator=g)
            worker.forward_backward([(w[:, :-1], w[:, 1:])])
            worker.optimizer_step()
        for p in range(len(worker.outer)):  # an outer round: gather, outer step, scatter
            delta, _ = worker.begin_sync(p)
            worker.apply_outer(p, delta)
        replicas._send(replicas.STOP)
    else:
        while True:
            op, a = replicas._receive()
            if op == replicas.STOP:
                break
            worker.follow(op, a)
    held = _state_bytes(worker)
    row = {"rank": worker.rank, "state_mib": held / MIB, "rss_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "gpu_peak_mib": torch.cuda.max_memory_allocated(device) / MIB if device.type == "cuda" else -1.0,
           "seconds": time.perf_counter() - t0}
    rows = [None] * worker.world
    dist.all_gather_object(rows, row)
    if worker.rank == 0:
        print("ROWS " + json.dumps(rows), flush=True)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="150m")
    ap.add_argument("--procs", type=int, default=2, help="processes (GPUs) of the node")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl, one GPU a process)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens a sequence (short: CPU time)")
    ap.add_argument("--rows", type=int, default=1, help="sequences a process trains each step")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--sharding", choices=("ddp", "fsdp", "both"), default="both")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--process", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.process:
        _process(args)
        return 0
    train = _config(args)
    rows = []
    for sharding in (("ddp", "fsdp") if args.sharding == "both" else (args.sharding,)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.procs}",
               __file__, "--process", "--sharding", sharding, "--preset", args.preset, "--procs", str(args.procs),
               "--device", args.device, "--seq-len", str(args.seq_len), "--rows", str(args.rows),
               "--steps", str(args.steps)]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        got = [line for line in out.stdout.splitlines() if line.startswith("ROWS ")]
        if out.returncode != 0 or not got:
            print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"sharded_memory: the {sharding} run failed (exit {out.returncode})")
        rows += [{"sharding": sharding, **r} for r in json.loads(got[0][5:])]
    print(f"preset {args.preset} ({train.model.num_params():,} params, fp32 {train.model.num_params() * 4 / MIB:,.0f} MiB), "
          f"{args.procs} processes on {args.device}, {args.rows} x {args.seq_len} tokens a process a step")
    print_table(rows, [("sharding", "sharding", "s"), ("rank", "rank", "d"), ("state_mib", "state MiB", ",.0f"),
                       ("rss_peak_mib", "peak RSS MiB", ",.0f"), ("gpu_peak_mib", "peak GPU MiB", ",.0f"),
                       ("seconds", "s", ".1f")])
    path = write_json(args.out, "sharded_memory", {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                                   "num_params": train.model.num_params()})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
