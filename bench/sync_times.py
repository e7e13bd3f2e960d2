"""How long each sync of the honest peers takes beside a lying peer, at the run's default pacing.

``bench/liar.py`` runs the swarm in lockstep and reports wall time and held-out loss, where a
sync's waits hide behind training. This one starts the demo's run (its manifest, so the
default all-reduce deadline and pacing) with three honest peers and, unless ``--lies`` is
empty, a fourth whose ``SWARMSTREAM_FAULT`` lies, and reads every honest peer's all-reduce
phases from its log: how long each of its syncs took, in order. The first sync beside a new
liar may take a whole deadline (or the agreement's 2.5); what the later ones take is what the
liar costs the swarm for good (``peer.quiet``).

    python bench/sync_times.py --lies lie:hush --rounds 8
    python bench/sync_times.py --lies lie:ghost --rounds 8
    python bench/sync_times.py --lies "" --rounds 8          # the three honest peers alone
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchutil import print_table, write_json  # noqa: E402

HONEST = (0, 1, 2)
PHASES = re.compile(r"phases pushes=([\d.]+) means=([\d.]+) agreed=([\d.]+) sent=([\d.]+)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lies", default="lie:hush", help="peer 3's SWARMSTREAM_FAULT ('' for no fourth peer)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--keep", action="store_true", help="keep the run's directory (peer logs)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/sync_times_<lie>.json)")
    args = ap.parse_args()
    from peer.demo import Demo, demo_manifest
    from protocol.identity import Identity

    peers = len(HONEST) + (1 if args.lies else 0)
    wd = Path(tempfile.mkdtemp(prefix="sync-times-"))
    try:
        for i in range(peers):  # the same identities in every run: the same groups for the same joins
            key = wd / f"peer{i}.key"
            key.write_bytes(Identity.from_seed(bytes([i + 1]) * 32).to_libp2p())
            key.chmod(0o600)
        envs = {i: {"SWARMSTREAM_LOG": "INFO"} for i in range(peers)}
        if args.lies:
            envs[peers - 1]["SWARMSTREAM_FAULT"] = args.lies
        last: dict[int, float] = {}  # honest peer -> when its last event came (its last landing, its summary)

        def on_event(i: int, ev: dict) -> None:
            if i in HONEST:
                last[i] = time.time()

        demo = Demo(peers, rounds=args.rounds, workdir=wd, on_event=on_event, envs=envs,
                    manifest=demo_manifest(peers, wd / "peer0.key"))
        t0 = time.time()
        demo.start()
        try:
            demo.wait()
        finally:
            demo.stop(5)
        # until the last honest peer was done: the liar may take longer to leave, which is not
        # the honest peers' time
        elapsed = max(last.values(), default=time.time()) - t0
        rows, per_peer = [], {}
        for i in HONEST:
            text = (wd / f"peer{i}.log").read_text()
            syncs = [float(m[3]) for m in PHASES.findall(text)]
            per_peer[i] = syncs
            summary = demo.summaries.get(i, {})
            rows.append({"peer": i, "syncs": len(syncs), "first": syncs[0] if syncs else float("nan"),
                         "later_median": statistics.median(syncs[1:]) if len(syncs) > 1 else float("nan"),
                         "later_max": max(syncs[1:], default=float("nan")),
                         "total": sum(syncs), "loss": float(summary.get("heldout_loss") or float("nan")),
                         "digest": str(summary.get("global_digest", ""))[:12]})
        print(f"honest peers' syncs beside {args.lies or 'nobody'}, {args.rounds} rounds, demo manifest: "
              f"{elapsed:.0f} s from the start until the last honest peer was done")
        print_table(rows, [("peer", "peer", "d"), ("syncs", "syncs", "d"), ("first", "first s", ".1f"),
                           ("later_median", "later median s", ".2f"), ("later_max", "later max s", ".1f"),
                           ("total", "sum s", ".1f"), ("loss", "held-out", ".4f"), ("digest", "copy", "s")])
        agree = len({r["digest"] for r in rows}) == 1
        print(f"honest copies identical: {agree}")
        name = "sync_times_" + (args.lies.removeprefix("lie:").replace("+", "_") or "none")
        print("wrote", write_json(args.out, name, {"lies": args.lies, "rounds": args.rounds, "honest_done_s": elapsed,
                                                  "honest_copies_identical": agree, "peers": rows,
                                                  "sync_s": {str(k): v for k, v in per_peer.items()}}))
    finally:
        if args.keep:
            print("kept", wd)
        else:
            shutil.rmtree(wd, ignore_errors=True)


if __name__ == "__main__":
    main()
