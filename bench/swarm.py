"""A real swarm on this machine: N nodes (``python -m peer.node``), each its own process and
libp2p daemon in its own network namespace behind a ``tc tbf`` upload cap, for tau = 0
against tau = 1.

    python bench/swarm.py --quick                 # N = 2, 4; 2 rounds, H = 100; ~3 min
    python bench/swarm.py                         # N = 2, 4, 8; 3 rounds, H = 160; ~10 min
    python bench/swarm.py --rate 100mbit --tau 0,1,5 --out bench/results/swarm_100mbit.json
    python bench/swarm.py --loopback              # all peers on 127.0.0.1, no cap
    python bench/swarm.py --peers 4 --tau 1 -H 40 --rounds 10 --slow 2   # one peer 2x slower

Per (N, tau, link) it prints and writes (JSON, with the machine and the commit):
- wall time of the run (start of the first node to the exit of the last) and rounds completed;
- blocked share: the share of each node's training-loop wall time that it was blocked on the
  network (waiting at a landing step for a group or a late result, plus peer lookups,
  agreement checks and state downloads between steps), mean over peers; the figure that
  overlap (tau) and pipelined matchmaking exist to bring to 0;
- effective utilization: sum over peers of (inner steps trained x bare step time) / the wall
  time of the peer's training loop (start-up is left out), where the bare step is measured in
  this process before and after the run (the fastest of four trials), with the same model,
  batch and torch threads, and no node running. 1.0 means the swarm trained as much per
  second as one process alone on the machine; shared cores or time blocked lower it, and
  nothing makes it look better (the old "time in steps / time in the loop" rose when peers
  slowed each other down, so it is gone);
- bytes sent and received per peer per round (a round = one sync of every fragment), and
  what the butterfly arithmetic and the codec's exact sizes expect (no message overhead);
- all-reduce latency, median and p90 over every sync of every peer (group formed to average
  decoded; matchmaking is not in it);
- how long training waited on the network per sync (``waited_s / syncs``): 0 when the
  average landed within tau steps. It holds matchmaking too, which is what tau must hide;
- late steps: how many steps past s + tau the results landed, mean over syncs and peers (with
  tau >= 1 a node trains on while its group's last member catches up, up to a tenth of H in
  all: ``peer.sync_pipeline.late_allowance``), so the overlap actually used is tau + this;
- syncs averaged alone, held-out loss of the global model (mean over peers), and whether all
  peers ended with the same global model (one group: they must).

With ``--slow F`` the last peer trains 1/F of the time (its volunteer setting
``compute.duty_cycle``); a second table shows the fast peers' blocked share, the slow peer's,
its inner steps over a fast peer's, how many of its syncs were in a group, and how far it moved
its step counter on (``peer.pace``: it follows the others' rounds with the steps it managed).

The run: tiny preset (``--preset``), ``stdlib`` corpus, Streaming DiLoCo with P = 2 and the fp4 codec, the
demo's swarm timings (matchmaking 5 s, all-reduce deadline 30 s), alpha = 0 at tau = 0 and
0.5 at tau > 0 (``protocol.config.SYNC_MODES``). Nodes join a sync's group ahead of
its start step (pipelined matchmaking), as soon as the fragment's previous round landed,
so a round of H - tau - 1 steps must last longer than the matchmaking floor (about
``0.5 * matchmaking_timeout_s``: the batch gap plus the settle time of ``peer.matchmaking``)
for the floor to be hidden.

Network: a bridge ``ssbench-br`` (10.77.0.254/24) and per peer a namespace ``ssbenchI`` with
a veth pair, the peer at 10.77.0.(I+1); the cap is a tbf qdisc on the peer's end of its veth,
so it limits what the peer sends (its upload). Needs root, ``ip`` and ``tc``; without them
the bench runs every peer on 127.0.0.1 with no cap and says so in the table and the JSON.
Namespaces, bridge and node processes are removed at the end of every run, and what a crashed
run left behind is removed at the start. ``netem`` is not available here; tbf is.

The machine's cores are shared by all peers (one torch thread each): with 8 peers on 2 cores,
an inner step is about 4x slower than alone, which raises utilization, not throughput.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchutil import print_table, write_json

from peer import netns
from peer.demo import Demo
from peer.identity_store import load_or_create_identity
from peer.settings_store import save_settings
from protocol.butterfly import bytes_sent
from protocol.codecs import get_codec
from protocol.config import (
    DataConfig,
    InnerConfig,
    SyncConfig,
    TrainConfig,
    model_preset,
)
from protocol.errors import ConfigError
from protocol.manifest import RunManifest, SwarmConfig, sign_manifest
from protocol.settings import ClientSettings, ComputeSettings, Settings

NS = "ssbench"  # namespaces ssbenchI on bridge ssbench-br (peer.netns)
SUBNET = "10.77.0"
# pids (= process groups: the demo starts each node in its own session) of the nodes of the run
# in progress, so a run that was killed outright can have its nodes killed by the next one
PIDFILE = Path(tempfile.gettempdir()) / "swarmstream-bench-swarm.pids"
TBF_LATENCY = "200ms"  # the longest a packet may queue behind the cap before tbf drops it


def rate_bits(rate: str) -> float:
    """tc's rate syntax, as far as this bench needs it: '20mbit' -> 20e6 (bits per second)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", rate.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"rate {rate!r}: use tc's syntax, e.g. 20mbit or 500kbit")
    return float(m[1]) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m[2]]


def preset_arg(name: str) -> str:
    """--preset: a model preset, checked before any run starts."""
    try:
        model_preset(name)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def rate_arg(text: str) -> str | None:
    """--rate: a tc rate (checked here, not at the first tc call) or 'none'."""
    if text == "none":
        return None
    rate_bits(text)
    return text


def kill_strays() -> None:
    """Kill the nodes a crashed run of this bench left running (checked by command line, so a
    pid reused since by something else is left alone)."""
    if not PIDFILE.exists():
        return
    for pid in (int(x) for x in PIDFILE.read_text().split()):
        try:
            if b"peer.node" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.killpg(pid, signal.SIGKILL)  # the node and its libp2p daemon
                print(f"killed node {pid} left by an earlier run", file=sys.stderr)
        except (FileNotFoundError, ProcessLookupError):
            pass  # already gone
    PIDFILE.unlink()


def teardown() -> None:
    netns.remove(NS)


def setup(n: int, rate: str | None) -> None:
    """Bridge, n namespaces with a veth pair each, and the upload cap on each peer's end."""
    # burst: 10 ms at the rate (tbf needs at least rate/HZ to reach it), not less than 16 KiB
    tbf = (rate, max(16 << 10, int(rate_bits(rate) / 8 / 100)), TBF_LATENCY) if rate else None
    netns.create(NS, SUBNET, n, tbf=tbf)


def netns_unavailable(rate: str | None) -> str:
    """Why this machine cannot run peers in namespaces behind caps ('' if it can)."""
    if os.geteuid() != 0:
        return "not root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"no {' or '.join(missing)} on PATH"
    try:
        setup(1, rate)  # one namespace with its cap, to find out
    except (netns.NetnsError, OSError, subprocess.SubprocessError) as e:
        return f"network setup failed: {e}"
    finally:
        teardown()
    return ""


def run_manifest(work: Path, tau: int, H: int, rounds: int, mm_timeout_s: float,
                 preset: str = "tiny") -> tuple[bytes, TrainConfig]:
    """The signed manifest of one run (like ``peer.demo.demo_manifest``, with our H and tau)."""
    ident = load_or_create_identity(work / "creator.key")
    train = TrainConfig(model=model_preset(preset), data=DataConfig(source="stdlib"),
                        inner=InnerConfig(lr=3e-3, warmup_steps=20, total_steps=rounds * H, batch_size=8),
                        sync=SyncConfig(inner_steps=H, fragments=2, overlap=tau, alpha=0.5 if tau else 0.0,
                                        codec="fp4"))
    swarm = SwarmConfig(group_size=8, matchmaking_timeout_s=mm_timeout_s, allreduce_timeout_s=30.0,
                        heartbeat_interval_s=3.0, heartbeat_ttl_s=10.0)
    m = RunManifest(name=f"bench tau={tau}", description="bench/swarm.py", train=train, swarm=swarm,
                    creator=ident.public_key, created_at=time.time())
    return sign_manifest(m, ident), train


def expected_bytes_per_round(train: TrainConfig, n: int) -> float:
    """What one peer sends, on average over the group, per round (every fragment once) in a
    group of n, by the butterfly arithmetic and the codec's exact sizes."""
    from peer.worker import Worker

    codec = get_codec(train.sync.codec)
    total = 0.0
    for frag in Worker(train).outer:
        total += sum(bytes_sent(frag.global_flat.numel(), n, codec.encoded_size, witness=bool(train.sync.clip))) / n
    return total


def bare_step_s(train: TrainConfig, corpus, steps: int = 10, warmup: int = 3) -> float:
    """The median time of one inner step of this run's model and batch, alone in this process
    (same torch threads as a node: torch's default), with no node running."""
    from peer.data import ShardSampler
    from peer.worker import Worker

    sampler = ShardSampler(corpus.train, train.model.seq_len, train.inner.batch_size, train.data.seed, "bench")
    worker = Worker(train, device="cpu")
    times = []
    for i in range(warmup + steps):
        batches = [sampler.next_batch() for _ in range(train.inner.grad_accum)]
        t0 = time.perf_counter()
        worker.forward_backward(batches)
        worker.optimizer_step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def p90(xs: list[float]) -> float:
    """Nearest-rank 90th percentile."""
    xs = sorted(xs)
    return xs[max(0, -(-9 * len(xs) // 10) - 1)] if xs else float("nan")


def run_one(n: int, tau: int, args: argparse.Namespace, netns: bool) -> dict:
    work = Path(tempfile.mkdtemp(prefix="ss-bench-"))
    signed, train = run_manifest(work, tau, args.inner_steps, args.rounds, args.matchmaking_timeout, args.preset)
    # the bare step, before and after the run: the fastest of the trials, since anything else
    # on the machine only slows a trial down (and a slow bare step would flatter the swarm)
    from peer.data import load_corpus

    corpus = load_corpus(train.data, train.model.vocab_size)  # read once for the four trials
    bare_trials = [bare_step_s(train, corpus), bare_step_s(train, corpus)]
    launcher = {i: ["ip", "netns", "exec", f"{NS}{i}"] for i in range(n)} if netns else None
    listen = {i: f"/ip4/{SUBNET}.{i + 1}/tcp/0" for i in range(n)} if netns else None
    if args.slow:  # the last peer trains 1/slow of the time (its volunteer setting compute.duty_cycle)
        save_settings(work / f"peer{n - 1}.toml", Settings(compute=ComputeSettings(duty_cycle=1.0 / args.slow),
                                                          client=ClientSettings(confirmed=True)))
    demo = Demo(n, rounds=args.rounds, workdir=work, manifest=signed, launcher=launcher, listen=listen,
                checkpoint_every_s=1e9)  # no checkpoints but the last: they are not what we measure
    timed_out = False
    t0 = time.monotonic()
    try:
        if netns:
            setup(n, args.rate)
        demo.start()
        PIDFILE.write_text(" ".join(str(p.pid) for p in demo.procs.values()))
        deadline = t0 + args.run_timeout
        for p in demo.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        wall = time.monotonic() - t0
        demo.stop()  # on a timeout: SIGINT, so the nodes land what is in flight and still report
        summary = demo.wait()
    finally:
        demo.stop()  # after a crash or Ctrl+C above: SIGINT, then SIGKILL to what is left
        if netns:
            teardown()
        PIDFILE.unlink(missing_ok=True)

    bare_trials += [bare_step_s(train, corpus), bare_step_s(train, corpus)]
    bare = min(bare_trials)
    s = [demo.summaries[i] for i in sorted(demo.summaries)]
    lat = [x for p in s for x in p["allreduce_s"]]
    syncs = sum(p["syncs"] for p in s)
    steps = sum(p["steps"] for p in s)
    rounds = [max(1, p["rounds"]) for p in s]
    fast = s[:-1] if args.slow and len(s) == n else s  # with --slow, the last peer is the slow one
    slow = s[-1] if args.slow and len(s) == n else None
    return {
        "peers": n, "tau": tau, "link": (args.rate or "no cap") if netns else "loopback", "slow": args.slow,
        "finished": len(s), "timed_out": timed_out, "errors": summary["errors"], "workdir": str(work),
        "wall_s": wall, "train_s": statistics.mean(p["wall_s"] for p in s) if s else float("nan"),
        "rounds": summary["rounds"], "steps_per_peer": steps / max(1, len(s)),
        "step_ms": 1e3 * sum(p["inner_s"] for p in s) / max(1, steps), "bare_step_ms": 1e3 * bare,
        "bare_step_trials_ms": [round(1e3 * t, 2) for t in bare_trials],
        "blocked_share": statistics.mean(p["blocked_s"] / p["wall_s"] for p in s) if s else float("nan"),
        "blocked_at_sync_share": statistics.mean(p["waited_s"] / p["wall_s"] for p in s) if s else float("nan"),
        # with --slow: the same for the fast peers alone, and what the slow one did
        "fast_blocked_share": statistics.mean(p["blocked_s"] / p["wall_s"] for p in fast) if fast else float("nan"),
        "slow_blocked_share": slow["blocked_s"] / slow["wall_s"] if slow else None,
        "slow_steps_share": (slow["steps_trained"] / statistics.mean(p["steps_trained"] for p in fast)
                             if slow and fast else None),  # its inner steps / a fast peer's
        "slow_syncs_in_groups": slow["syncs"] - slow["syncs_alone"] if slow else None,
        "slow_steps_skipped": slow["steps_skipped"] if slow else None,
        "effective_utilization": sum(p["steps_trained"] * bare / max(1e-9, p["wall_s"]) for p in s),
        "sent_kb_per_round": statistics.mean(p["bytes_sent"] / r for p, r in zip(s, rounds)) / 1e3 if s else 0.0,
        "recv_kb_per_round": statistics.mean(p["bytes_received"] / r for p, r in zip(s, rounds)) / 1e3 if s else 0.0,
        "expected_kb_per_round": expected_bytes_per_round(train, n) / 1e3,
        "allreduce_median_s": statistics.median(lat) if lat else float("nan"),
        "allreduce_p90_s": p90(lat),
        "syncs": syncs, "waited_per_sync_s": sum(p["waited_s"] for p in s) / max(1, syncs),
        # steps past s + tau at which results landed (trained on while a late result came)
        "landed_late_steps": statistics.mean(p.get("landed_late_steps", 0.0) for p in s) if s else float("nan"),
        "syncs_alone": summary["syncs_alone"], "heldout_loss": summary["heldout_loss"] or float("nan"),
        "global_copies_agree": summary["global_copies_agree"],
        "digests": len({p["global_digest"] for p in s}),
        "summaries": s,  # every node's own summary line, for a closer look
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="2,4,8", help="comma-separated swarm sizes (default 2,4,8)")
    ap.add_argument("--tau", default="0,1", help="comma-separated overlaps tau, in inner steps (default 0,1)")
    ap.add_argument("--rounds", type=int, help="rounds of every fragment per run (default 3, quick 2)")
    ap.add_argument("-H", "--inner-steps", type=int,
                    help="H, inner steps per round (default 160, quick 100): long enough that compute, "
                         "not the ~2.5 s matchmaking floor per sync, fills most of a round")
    ap.add_argument("--rate", default="20mbit", type=rate_arg,
                    help="tbf upload cap per peer in tc syntax (default 20mbit; 'none': namespaces, no cap)")
    ap.add_argument("--loopback", action="store_true", help="all peers on 127.0.0.1, no namespaces, no cap")
    ap.add_argument("--matchmaking-timeout", type=float, default=5.0,
                    help="the run's matchmaking_timeout_s (default 5, the demo's); ~half of it is waited per sync")
    ap.add_argument("--run-timeout", type=float, default=300.0,
                    help="seconds before a run's nodes are stopped and it is reported as timed out (default 300)")
    ap.add_argument("--preset", default="tiny", type=preset_arg, help="model preset of the run (default tiny)")
    ap.add_argument("--quick", action="store_true", help="N = 2, 4; 2 rounds of H = 100 (~3 min)")
    ap.add_argument("--slow", type=float, default=0.0, metavar="FACTOR",
                    help="make the last peer FACTOR times slower (its compute.duty_cycle = 1/FACTOR); the table "
                         "then shows the fast peers' blocked share and what the slow one contributed")
    ap.add_argument("--out", type=Path, help="JSON path (default bench/results/swarm.json)")
    args = ap.parse_args()
    if args.slow and not 1.0 <= args.slow <= 20.0:
        ap.error(f"--slow must be between 1 and 20 (a factor), got {args.slow:g}")
    peers = [2, 4] if args.quick else [int(x) for x in args.peers.split(",")]
    taus = [int(x) for x in args.tau.split(",")]
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.inner_steps = args.inner_steps or (100 if args.quick else 160)

    kill_strays()
    reason = "--loopback" if args.loopback else netns_unavailable(args.rate)
    netns = not reason
    network = (f"one namespace per peer, tbf upload cap {args.rate or 'none'}" if netns
               else f"127.0.0.1, no cap ({reason})")
    print(f"network: {network}", file=sys.stderr, flush=True)

    rows = []
    for n in peers:
        for tau in taus:
            print(f"running {n} peers, tau={tau}, {args.rounds} rounds of H={args.inner_steps} ...",
                  file=sys.stderr, flush=True)
            row = run_one(n, tau, args, netns)
            rows.append(row)
            print(f"  {row['wall_s']:.0f} s, {row['finished']}/{n} finished, blocked {row['blocked_share']:.1%}, "
                  f"effective utilization {row['effective_utilization']:.2f}, "
                  f"waited {row['waited_per_sync_s']:.2f} s/sync" + (" TIMED OUT" if row["timed_out"] else ""),
                  file=sys.stderr, flush=True)
            for err in row["errors"]:
                print(f"  {err}", file=sys.stderr)

    print()
    print(f"{args.preset} preset, P=2, fp4, H={args.inner_steps}, {args.rounds} rounds; network: {network}")
    print_table(rows, [("peers", "N", "d"), ("tau", "tau", "d"), ("link", "link", "s"),
                       ("finished", "done", "d"), ("wall_s", "wall s", ".0f"), ("rounds", "rounds", "d"),
                       ("step_ms", "step ms", ".0f"), ("bare_step_ms", "bare ms", ".0f"),
                       ("blocked_share", "blocked", ".1%"), ("blocked_at_sync_share", "at sync", ".1%"),
                       ("effective_utilization", "eff util", ".2f"),
                       ("sent_kb_per_round", "sent KB/rnd", ".1f"), ("expected_kb_per_round", "expect KB", ".1f"),
                       ("recv_kb_per_round", "recv KB/rnd", ".1f"), ("allreduce_median_s", "AR med s", ".2f"),
                       ("allreduce_p90_s", "AR p90 s", ".2f"), ("waited_per_sync_s", "wait/sync s", ".2f"),
                       ("landed_late_steps", "late steps", ".1f"), ("syncs_alone", "alone", "d"), ("heldout_loss", "held-out", ".4f"),
                       ("global_copies_agree", "agree", "")])
    if args.slow:
        print(f"\nwith the last peer {args.slow:g}x slower (compute.duty_cycle = {1 / args.slow:.2f}):")
        print_table(rows, [("peers", "N", "d"), ("tau", "tau", "d"), ("fast_blocked_share", "fast blocked", ".1%"),
                           ("slow_blocked_share", "slow blocked", ".1%"),
                           ("slow_steps_share", "slow steps / fast", ".2f"),
                           ("slow_syncs_in_groups", "slow syncs in groups", "d"), ("syncs_alone", "alone (all)", "d"),
                           ("slow_steps_skipped", "slow steps moved on", "d"), ("global_copies_agree", "agree", "")])
    out = write_json(args.out, "swarm", {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "network": {"namespaces": netns, "rate": args.rate if netns else None, "fallback_reason": reason or None,
                    "description": network},
        "rows": rows})
    print(f"\nwrote {out}")
    return 0 if all(r["finished"] == r["peers"] and not r["timed_out"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
