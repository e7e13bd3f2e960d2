"""A real swarm on this machine: N nodes, each its own process and libp2p daemon, optionally in
its own network namespace behind a ``tc tbf`` upload cap, for tau = 0 against tau > 0.

Per run it prints and writes (JSON, with the machine and the commit):
- compute utilization: time in inner steps / wall time, summed over peers;
- bytes sent and received per peer per round, and what the butterfly arithmetic expects;
- all-reduce latency (median and p90 over every sync of every peer);
- how long training waited on the network per sync (``waited_s``: 0 when the average landed
  within tau steps), which is what overlap (tau > 0) is meant to hide;
- syncs alone, held-out loss, and whether all peers ended with the same global model.

    python bench/swarm.py --quick                     # N = 2, 4 on loopback, ~3 min
    python bench/swarm.py                             # N = 2, 4, 8, tau 0 and 1, ~10 min
    sudo python bench/swarm.py --netns --rate 20mbit  # each peer in a namespace, 20 Mbit/s up

Namespaces: a bridge ``ssbr0`` (10.77.0.254/24) and per peer a namespace ``ssN`` with a veth
pair, the peer at 10.77.0.N+1; the cap is a tbf qdisc on the peer's side of its veth. Everything
is removed at the end, and left-overs of a crashed run at the start. Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchutil import print_table, write_json  # noqa: E402

from peer.demo import Demo  # noqa: E402
from peer.identity_store import load_or_create_identity  # noqa: E402
from protocol.butterfly import bytes_sent  # noqa: E402
from protocol.codecs import get_codec  # noqa: E402
from protocol.config import DataConfig, InnerConfig, SyncConfig, TrainConfig, model_preset  # noqa: E402
from protocol.manifest import RunManifest, SwarmConfig, sign_manifest  # noqa: E402

BRIDGE = "ssbr0"


def sh(*cmd: str, check: bool = True) -> None:
    subprocess.run(cmd, check=check, capture_output=True, timeout=30)


def teardown(n: int = 16) -> None:
    for i in range(n):
        sh("ip", "netns", "del", f"ss{i}", check=False)
        sh("ip", "link", "del", f"vss{i}", check=False)
    sh("ip", "link", "del", BRIDGE, check=False)


def setup(n: int, rate: str | None) -> None:
    teardown()
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "addr", "add", "10.77.0.254/24", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")
    for i in range(n):
        ns, host, peer = f"ss{i}", f"vss{i}", f"vssp{i}"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", host, "type", "veth", "peer", "name", peer)
        sh("ip", "link", "set", peer, "netns", ns)
        sh("ip", "link", "set", host, "master", BRIDGE)
        sh("ip", "link", "set", host, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"10.77.0.{i + 1}/24", "dev", peer)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", peer, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        if rate:
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", peer, "root", "tbf", "rate", rate,
               "burst", "64kb", "latency", "400ms")


def manifest(work: Path, tau: int, H: int, group_size: int) -> tuple[bytes, TrainConfig]:
    ident = load_or_create_identity(work / "creator.key")
    train = TrainConfig(model=model_preset("tiny"), data=DataConfig(source="stdlib"),
                        inner=InnerConfig(lr=3e-3, warmup_steps=20, total_steps=2000, batch_size=8),
                        sync=SyncConfig(inner_steps=H, fragments=2, overlap=tau, alpha=0.5 if tau else 0.0,
                                        codec="fp4"))
    swarm = SwarmConfig(group_size=group_size, matchmaking_timeout_s=5.0, allreduce_timeout_s=30.0,
                        heartbeat_interval_s=3.0, heartbeat_ttl_s=10.0)
    m = RunManifest(name=f"bench tau={tau}", description="bench/swarm.py", train=train, swarm=swarm,
                    creator=ident.public_key, created_at=time.time())
    return sign_manifest(m, ident), train


def expected_bytes_per_round(train: TrainConfig, n: int) -> float:
    """What one peer sends per full round (every fragment once) in a group of n, by the
    butterfly arithmetic and the codec's exact sizes."""
    from peer.worker import Worker

    codec = get_codec(train.sync.codec)
    worker = Worker(train)
    total = 0
    for frag in worker.outer:
        sent = bytes_sent(frag.global_flat.numel(), n, codec.encoded_size)
        total += sum(sent) / n
    return total


def run_one(n: int, tau: int, rounds: int, H: int, netns: bool, rate: str | None) -> dict:
    work = Path(tempfile.mkdtemp(prefix="ss-bench-", dir="/tmp"))
    signed, train = manifest(work, tau, H, group_size=max(8, n))
    launcher = {i: ["ip", "netns", "exec", f"ss{i}"] for i in range(n)} if netns else None
    listen = {i: f"/ip4/10.77.0.{i + 1}/tcp/0" for i in range(n)} if netns else None
    if netns:
        setup(n, rate)
    demo = Demo(n, rounds=rounds, workdir=work, manifest=signed, launcher=launcher, listen=listen,
                checkpoint_every_s=1e9)
    t0 = time.monotonic()
    try:
        demo.start()
        summary = demo.wait()
    finally:
        demo.stop()
        if netns:
            teardown(n)
    wall = time.monotonic() - t0
    s = list(demo.summaries.values())
    if len(s) < n:
        raise SystemExit(f"bench: only {len(s)} of {n} peers finished; logs in {work}")
    lat = sorted(x for p in s for x in p["allreduce_s"])
    syncs = sum(p["syncs"] for p in s)
    per_round = [p["bytes_sent"] / max(1, p["rounds"]) for p in s]
    recv_round = [p["bytes_received"] / max(1, p["rounds"]) for p in s]
    return {
        "peers": n, "tau": tau, "rate": rate or ("none" if netns else "loopback"), "wall_s": wall,
        "rounds": summary["rounds"], "utilization": sum(p["inner_s"] for p in s) / sum(p["wall_s"] for p in s),
        "sent_kb_per_round": statistics.mean(per_round) / 1e3,
        "recv_kb_per_round": statistics.mean(recv_round) / 1e3,
        "expected_kb_per_round": expected_bytes_per_round(train, n) / 1e3,
        "allreduce_median_s": statistics.median(lat) if lat else float("nan"),
        "allreduce_p90_s": lat[int(0.9 * (len(lat) - 1))] if lat else float("nan"),
        "waited_per_sync_s": sum(p["waited_s"] for p in s) / max(1, syncs),
        "syncs_alone": summary["syncs_alone"], "heldout": summary["heldout_loss"],
        "agree": summary["global_copies_agree"], "workdir": str(work),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="2,4,8", help="comma-separated swarm sizes (default 2,4,8)")
    ap.add_argument("--tau", default="0,1", help="comma-separated overlaps in inner steps (default 0,1)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every fragment per run (default 3)")
    ap.add_argument("-H", "--inner-steps", type=int, default=20)
    ap.add_argument("--netns", action="store_true", help="one network namespace per peer (root)")
    ap.add_argument("--rate", help="tbf upload cap per peer with --netns, e.g. 20mbit or 100mbit")
    ap.add_argument("--quick", action="store_true", help="N = 2, 4 and 2 rounds")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.netns and os.geteuid() != 0:
        raise SystemExit("bench: --netns needs root (ip netns, tc); run without it for loopback")
    if args.rate and not args.netns:
        raise SystemExit("bench: --rate needs --netns (the cap is a tbf qdisc on each peer's veth)")
    peers = [2, 4] if args.quick else [int(x) for x in args.peers.split(",")]
    rounds = 2 if args.quick else args.rounds
    rows = []
    for n in peers:
        for tau in (int(x) for x in args.tau.split(",")):
            print(f"running {n} peers, tau={tau}, {rounds} rounds ...", file=sys.stderr, flush=True)
            rows.append(run_one(n, tau, rounds, args.inner_steps, args.netns, args.rate))
    print_table(rows, [("peers", "N", "d"), ("tau", "tau", "d"), ("rate", "link", "s"), ("wall_s", "wall s", ".0f"),
                       ("rounds", "rounds", "d"), ("utilization", "util", ".2f"),
                       ("sent_kb_per_round", "sent KB/rnd", ".1f"), ("expected_kb_per_round", "expect KB", ".1f"),
                       ("recv_kb_per_round", "recv KB/rnd", ".1f"), ("allreduce_median_s", "AR med s", ".2f"),
                       ("allreduce_p90_s", "AR p90 s", ".2f"), ("waited_per_sync_s", "wait/sync s", ".2f"),
                       ("syncs_alone", "alone", "d"), ("heldout", "held-out", ".4f"), ("agree", "agree", "")])
    out = write_json(args.out, "swarm", {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
