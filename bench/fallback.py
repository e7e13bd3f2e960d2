"""What a part with no agreed mean costs the model: kept local weights against reset ones.

In the swarm a part of a fragment falls back (no agreed mean: every member takes a zero delta
there) when its reducer fails: it crashed, its mean was refused, or it is a key that leads
a group and then reduces nothing (``lie:ghost``, ``lie:hush``; a leader never idles itself).
The node used to reset its local weights there to the global copy, as everywhere else, so
the inner steps' progress on that part was lost; it now keeps them, and the progress goes
into the fragment's next pseudo-gradient (``OuterFragment.carry``: a lone fallback; where the
last sync fell back too they are reset as before, so a part that falls back every round
cannot drift without bound). The parts falling back here rotate, so each is a lone one.

This runs the in-process simulation (``peer.simulation``, the real engine and all-reduce) on
the same data and init three ways per seed: no fallback, a part falling back every
``--every`` syncs with the local weights reset there (before), and kept (now). Prints a
table and writes JSON; the differences are in percent of the run without fallback, per seed.

    python bench/fallback.py                  # 4 workers x 120 steps, H=20, P=2, seeds 0 1 2 (~6 min)
    python bench/fallback.py --every 2 --seeds 0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchutil import print_table, write_json  # noqa: E402

from peer.data import load_corpus  # noqa: E402
from peer.simulation import SimulationConfig, run_simulation  # noqa: E402
from protocol.config import DataConfig, InnerConfig, SyncConfig, TrainConfig, model_preset  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=120, help="inner steps per worker (default 120)")
    ap.add_argument("-H", "--inner-steps", type=int, default=20)
    ap.add_argument("-P", "--fragments", type=int, default=2)
    ap.add_argument("--every", type=int, default=4,
                    help="a part falls back every this many syncs (default 4: a ghost leading one group in four)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", help="JSON path (default bench/results/fallback.json)")
    args = ap.parse_args()
    if args.every < 1 or args.workers < 2:
        ap.error("--every must be >= 1 and --workers >= 2")

    model = model_preset(args.preset)
    inner = InnerConfig(lr=args.lr, warmup_steps=max(1, args.steps // 20), total_steps=args.steps,
                        batch_size=args.batch_size)
    sync = SyncConfig(inner_steps=args.inner_steps, fragments=args.fragments, overlap=1, alpha=0.5, codec="fp4")
    ways = [("none", 0, False), ("reset (before)", args.every, True), ("kept (now)", args.every, False)]
    runs = []
    for seed in args.seeds:
        data = DataConfig(source="stdlib", seed=seed)
        corpus = load_corpus(data, model.vocab_size)
        tc = TrainConfig(model=model, data=data, inner=inner, sync=sync)
        base = None
        for name, every, reset in ways:
            print(f"seed {seed}: {name} ...", file=sys.stderr, flush=True)
            res = run_simulation(SimulationConfig(train=tc, workers=args.workers, steps=args.steps, eval_batches=16,
                                                  fallback_every=every, fallback_resets_local=reset), corpus)
            base = res.heldout_loss if base is None else base
            runs.append({"seed": seed, "fallback": name, "every": every, "syncs": res.sync_events,
                         "heldout_loss": res.heldout_loss, "vs_none": res.heldout_loss / base - 1, "wall_s": res.wall_s})
    print()
    print(f"{args.workers} workers x {args.steps} inner steps, preset {args.preset}, H={args.inner_steps}, "
          f"P={args.fragments}, tau=1 alpha=0.5 fp4; a part of 1/{args.workers} falls back every {args.every} syncs")
    print_table(runs, [("seed", "seed", "d"), ("fallback", "fallback", ""), ("syncs", "syncs", "d"),
                       ("heldout_loss", "held-out", ".4f"), ("vs_none", "vs none", "+.2%"), ("wall_s", "wall s", ".0f")])
    for name in ("reset (before)", "kept (now)"):
        d = [r["vs_none"] for r in runs if r["fallback"] == name]
        print(f"{name}: mean {sum(d) / len(d):+.2%} over {len(d)} seeds")
    write_json(args.out, "fallback",
               {"workers": args.workers, "steps": args.steps, "inner_steps": args.inner_steps,
                "fragments": args.fragments, "every": args.every, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
