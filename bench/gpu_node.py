"""Whole nodes on a GPU: throughput, memory, and what pause gives back.

Starts N real nodes (``python -m peer.node``, as ``swarmstream demo`` does) on one machine with
``--device cuda`` (or another device), lets them average a few rounds, then pauses peer 0
through its control socket and reads the GPU memory each node process holds (nvidia-smi) before
the pause, while paused, and after it resumed. Checks that the peers' global copies agree at
the end. Prints a table and writes JSON (machine, commit).

    python bench/gpu_node.py --device cuda --preset 150m --peers 2 --rounds 3
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

from peer.demo import Demo  # noqa: E402
from peer.identity_store import load_or_create_identity  # noqa: E402
from protocol.config import DataConfig, InnerConfig, SyncConfig, TrainConfig, model_preset  # noqa: E402
from protocol.manifest import RunManifest, SwarmConfig, sign_manifest  # noqa: E402
from protocol.messages_control import FinishAndStop, GetStatus, PauseTraining, ResumeTraining  # noqa: E402
from tui.control_client import ControlError, call  # noqa: E402


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
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ss-gpu-", dir="/tmp"))
    ident = load_or_create_identity(work / "creator.key")
    train = TrainConfig(model=model_preset(args.preset), data=DataConfig(source="stdlib"),
                        inner=InnerConfig(lr=3e-4, warmup_steps=20, total_steps=100_000, batch_size=args.batch_size),
                        sync=SyncConfig(inner_steps=args.inner_steps, fragments=2, overlap=1, alpha=0.5, codec="fp4"))
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

    demo = Demo(args.peers, rounds=None, workdir=work, on_event=on_event, manifest=manifest, device=args.device)
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
            "mem_training_mib": mem_training.get(pid, -1), "mem_paused_mib": mem_paused.get(pid, -1) if i == 0 else -1,
            "mem_resumed_mib": mem_resumed.get(pid, -1), "rounds": demo.summaries.get(i, {}).get("rounds", -1),
            "heldout": demo.summaries.get(i, {}).get("heldout_loss", float("nan")),
        })
    print(f"{args.peers} nodes, preset {args.preset} ({train.model.num_params():,} params), device {args.device}, "
          f"batch {args.batch_size}x{train.model.seq_len}, H={args.inner_steps}; wall {wall:.0f} s; "
          f"global copies agree: {summary['global_copies_agree']}; paused device: {paused.device!r}")
    print_table(rows, [("peer", "peer", "d"), ("device", "device", "s"), ("tokens_per_s", "tokens/s", ",.0f"),
                       ("step_ms", "step ms", ".1f"), ("mem_training_mib", "MiB training", "d"),
                       ("mem_paused_mib", "MiB paused", "d"), ("mem_resumed_mib", "MiB resumed", "d"),
                       ("rounds", "rounds", "d"), ("heldout", "held-out", ".4f")])
    out = write_json(args.out, "gpu_node", {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                            "summary": summary, "wall_s": wall})
    print(f"wrote {out}")
    return 0 if summary["global_copies_agree"] and not summary["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
