"""Whole nodes on a GPU: throughput, memory, and what pause gives back; or, with
``--no-swarm``, one node's training alone: what fits on a GPU of a given size, and how fast.

Starts N real nodes (``python -m peer.node``, as ``swarmstream demo`` does) on one machine with
``--device cuda`` (or another device), lets them average a few rounds, then pauses peer 0
through its control socket and reads the GPU memory each node process holds (nvidia-smi) before
the pause, while paused, and after it resumed (with ``--gpus N``, each node is N processes,
one per GPU, and the memory is the most one of them holds; ``--sharding fsdp`` splits the model
over them, ``ddp`` copies it). Checks that the peers' global
copies agree at the end. Prints a table and writes JSON (machine, commit).

    python bench/gpu_node.py --device cuda --preset 150m --peers 2 --rounds 3

``--no-swarm`` builds the node's worker as a node does (``peer.worker.device_options``: bf16
autocast, activation checkpointing from 500M parameters, fused AdamW), caps the process at
``--memory-gb`` of the GPU (``torch.cuda.set_per_process_memory_fraction``, as the volunteer
setting ``gpu_memory_fraction`` does), runs inner steps on random tokens, one outer round
(every fragment's pseudo-gradient to the host, outer step, merge) and a held-out evaluation of
the global model, and reports tokens/s, the peak GPU memory of each phase, and the host RAM
the swarm state takes (global copies and outer momentum) against the fp32 model. It needs no
network stack (hivemind), so it runs wherever torch sees the GPU:

    python bench/gpu_node.py --no-swarm --preset 1b --batch-size 16 --micro-batch 4 --memory-gb 24
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchutil import print_table, write_json  # noqa: E402

from protocol.config import DataConfig, InnerConfig, SyncConfig, TrainConfig, model_preset  # noqa: E402


def gpu_memory_mib() -> dict[int, int]:
    """pid -> MiB of GPU memory it holds (nvidia-smi), {} where there is no NVIDIA GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    mem = {}
    for line in out.strip().splitlines():
        pid, used = (x.strip() for x in line.split(","))
        mem[int(pid)] = int(used)
    return mem


def tree(pid: int) -> set[int]:
    """``pid`` and its descendants (a node with --gpus N is torchrun and its N processes)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo += children.get(p, [])
    return out


def per_gpu(mem: dict[int, int], pid: int) -> int:
    """The most GPU memory one process of the node at ``pid`` holds (one process per GPU), -1 if none."""
    return max((mem[p] for p in tree(pid) if p in mem), default=-1)


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.5)
    raise SystemExit(f"gpu_node: timed out waiting for {what}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="rounds before the pause")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("-H", "--inner-steps", type=int, default=50)
    ap.add_argument("--no-swarm", action="store_true", help="one node's training alone (see above)")
    ap.add_argument("--micro-batch", type=int, default=0, help="--no-swarm: sequences per micro-batch "
                    "(the volunteer setting max_batch_size; 0: the whole batch)")
    ap.add_argument("--memory-gb", type=float, default=0.0, help="--no-swarm: cap the process at this much "
                    "GPU memory (0: no cap)")
    ap.add_argument("--steps", type=int, default=10, help="--no-swarm: timed inner steps")
    ap.add_argument("--fragments", type=int, default=2)
    ap.add_argument("--gpus", type=int, default=1, help="processes (GPUs) per node (peer.node --gpus)")
    ap.add_argument("--sharding", choices=("auto", "ddp", "fsdp"), default="auto",
                    help="with --gpus N > 1: how each node splits its training (peer.node --sharding)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    return one_worker(args) if args.no_swarm else swarm(args)


def swarm(args: argparse.Namespace) -> int:
    from peer.demo import Demo
    from peer.identity_store import load_or_create_identity
    from protocol.manifest import RunManifest, SwarmConfig, sign_manifest
    from protocol.messages_control import FinishAndStop, GetStatus, PauseTraining, ResumeTraining
    from tui.control_client import ControlError, call

    work = Path(tempfile.mkdtemp(prefix="ss-gpu-", dir="/tmp"))
    ident = load_or_create_identity(work / "creator.key")
    train = TrainConfig(model=model_preset(args.preset), data=DataConfig(source="stdlib"),
                        inner=InnerConfig(lr=3e-4, warmup_steps=20, total_steps=100_000, batch_size=args.batch_size),
                        sync=SyncConfig(inner_steps=args.inner_steps, fragments=args.fragments, overlap=1, alpha=0.5, codec="fp4"))
    swarm = SwarmConfig(group_size=8, matchmaking_timeout_s=5.0, allreduce_timeout_s=60.0, heartbeat_interval_s=3.0,
                        heartbeat_ttl_s=10.0)
    manifest = sign_manifest(RunManifest(name=f"gpu check {args.preset}", description="bench/gpu_node.py",
                                         train=train, swarm=swarm, creator=ident.public_key,
                                         created_at=time.time()), ident)
    synced: list[tuple[float, int, dict]] = []
    lock = threading.Lock()

    def on_event(i: int, ev: dict) -> None:
        if ev.get("event") == "synced":
            with lock:
                synced.append((time.monotonic(), i, ev))

    demo = Demo(args.peers, rounds=None, workdir=work, on_event=on_event, manifest=manifest, device=args.device,
                args={i: ["--gpus", str(args.gpus), "--sharding", args.sharding] for i in range(args.peers)}
                if args.gpus > 1 else None)
    t0 = time.monotonic()
    demo.start()
    sock = demo.control_path(0)
    try:
        def all_at_rounds() -> bool:
            try:
                return all(call(demo.control_path(i), GetStatus).rounds_done >= args.rounds for i in range(args.peers))
            except ControlError:  # a peer's socket is not up yet
                return False

        wait_for(all_at_rounds, 900, f"{args.rounds} rounds")
        statuses = [call(demo.control_path(i), GetStatus) for i in range(args.peers)]
        mem_training = gpu_memory_mib()
        call(sock, PauseTraining)
        paused = wait_for(lambda: (s := call(sock, GetStatus)).state == "paused" and s, 300, "the pause")
        time.sleep(2.0)  # let the allocator's release show in nvidia-smi
        mem_paused = gpu_memory_mib()
        call(sock, ResumeTraining)
        t_resume = time.monotonic()
        wait_for(lambda: any(i == 0 and t > t_resume and not ev["alone"] for t, i, ev in synced), 600,
                 "peer 0 to average again")
        mem_resumed = gpu_memory_mib()
        for i in range(args.peers):  # each finishes its round and contributes it, so the copies agree
            call(demo.control_path(i), FinishAndStop)
        summary = demo.wait()
    finally:
        demo.stop(timeout=120)
    wall = time.monotonic() - t0
    rows = []
    for i in range(args.peers):
        pid = demo.procs[i].pid
        st = statuses[i]
        rows.append({
            "peer": i, "device": st.device, "tokens_per_s": st.tokens_per_s, "step_ms": st.inner_step_s * 1e3,
            "gpus": args.gpus, "sharding": args.sharding if args.gpus > 1 else "-", "mem_training_mib": per_gpu(mem_training, pid),
            "mem_paused_mib": per_gpu(mem_paused, pid) if i == 0 else -1,
            "mem_resumed_mib": per_gpu(mem_resumed, pid), "rounds": demo.summaries.get(i, {}).get("rounds", -1),
            "heldout": demo.summaries.get(i, {}).get("heldout_loss", float("nan")),
        })
    print(f"{args.peers} nodes, preset {args.preset} ({train.model.num_params():,} params), device {args.device}, "
          f"batch {args.batch_size}x{train.model.seq_len}, H={args.inner_steps}; wall {wall:.0f} s; "
          f"global copies agree: {summary['global_copies_agree']}; paused device: {paused.device!r}")
    print_table(rows, [("peer", "peer", "d"), ("device", "device", "s"), ("gpus", "GPUs", "d"),
                       ("sharding", "sharding", "s"), ("tokens_per_s", "tokens/s", ",.0f"),
                       ("step_ms", "step ms", ".1f"), ("mem_training_mib", "MiB/GPU training", "d"),
                       ("mem_paused_mib", "MiB paused", "d"), ("mem_resumed_mib", "MiB resumed", "d"),
                       ("rounds", "rounds", "d"), ("heldout", "held-out", ".4f")])
    out = write_json(args.out, "gpu_node", {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                            "summary": summary, "wall_s": wall})
    print(f"wrote {out}")
    return 0 if summary["global_copies_agree"] and not summary["errors"] else 1


def one_worker(args: argparse.Namespace) -> int:
    import resource

    import torch

    from peer.worker import Worker, device_options, pick_device

    device = pick_device(args.device)
    cuda = device.type == "cuda"
    model = model_preset(args.preset)
    train = TrainConfig(model=model, data=DataConfig(source="stdlib"),
                        inner=InnerConfig(lr=3e-4, warmup_steps=20, total_steps=100_000, batch_size=args.batch_size),
                        sync=SyncConfig(inner_steps=args.inner_steps, fragments=args.fragments, overlap=1, alpha=0.5,
                                        codec="fp4"))
    if cuda and args.memory_gb:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gb * 2**30 / total), device)
    opts = device_options(train, device)
    micro = args.micro_batch or args.batch_size
    if args.batch_size % micro:
        raise SystemExit("gpu_node: --micro-batch must divide --batch-size")
    gen = torch.Generator().manual_seed(0)

    def batch(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        w = torch.randint(0, model.vocab_size, (n, model.seq_len + 1), generator=gen)
        return [(w[i:i + micro, :-1], w[i:i + micro, 1:]) for i in range(0, n, micro)]

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def peak_mib() -> float:
        if not cuda:
            return float("nan")
        got = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
        return got

    row: dict = {"preset": args.preset, "params": model.num_params(), "batch": args.batch_size, "micro": micro,
                 "cap_gb": args.memory_gb, **opts, "fits": True}
    try:
        t = time.perf_counter()
        worker = Worker(train, device=device, **opts)
        sync()
        row["build_s"], row["mem_weights_mib"] = time.perf_counter() - t, peak_mib()
        warmup = 2
        for i in range(warmup + args.steps):
            if i == warmup:
                sync()
                t = time.perf_counter()
            worker.forward_backward(batch(args.batch_size))
            worker.optimizer_step()
        sync()
        step_s = (time.perf_counter() - t) / args.steps
        row["step_s"], row["tokens_per_s"] = step_s, args.batch_size * model.seq_len / step_s
        row["mem_train_mib"] = peak_mib()
        t = time.perf_counter()
        for p in range(len(worker.outer)):  # one worker's round: its own pseudo-gradient is the mean
            delta, _ = worker.begin_sync(p)
            worker.apply_outer(p, delta)
            del delta
        sync()
        row["outer_round_s"], row["mem_outer_mib"] = time.perf_counter() - t, peak_mib()
        t = time.perf_counter()
        row["heldout"] = worker.evaluate_global(batch(micro))
        sync()
        row["eval_s"], row["mem_eval_mib"] = time.perf_counter() - t, peak_mib()
        swarm_bytes = sum(f.global_flat.nbytes + sum(b.nbytes for st in f.opt.state.values() for b in st.values())
                          for f in worker.outer)
        row["swarm_state_x_fp32"] = swarm_bytes / (4 * model.num_params())
    except torch.cuda.OutOfMemoryError as e:
        row["fits"] = False
        row["error"] = str(e).splitlines()[0][:200]
    row["host_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    row["device_name"] = torch.cuda.get_device_name(device) if cuda else str(device)
    cols = [("preset", "preset", "s"), ("params", "params", ",d"), ("batch", "batch", "d"), ("micro", "micro", "d"),
            ("cap_gb", "cap GB", ".0f"), ("fits", "fits", "")]
    if row["fits"]:
        cols += [("tokens_per_s", "tokens/s", ",.0f"), ("step_s", "step s", ".3f"),
                 ("mem_train_mib", "MiB train", ",.0f"), ("mem_outer_mib", "MiB outer", ",.0f"),
                 ("mem_eval_mib", "MiB eval", ",.0f"), ("outer_round_s", "outer s", ".2f"),
                 ("swarm_state_x_fp32", "swarm state / fp32 model", ".2f"), ("host_peak_rss_mib", "host peak MiB", ",.0f")]
    print(f"one worker, no swarm: {row['device_name']}, bf16 {opts['bf16']}, checkpointing {opts['checkpointing']}")
    print_table([row], cols)
    if not row["fits"]:
        print(f"does not fit: {row['error']}")
    out = write_json(args.out, f"gpu_worker_{args.preset}", {"args": {k: str(v) for k, v in vars(args).items()},
                                                            "rows": [row]})
    print(f"wrote {out}")
    return 0 if row["fits"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
