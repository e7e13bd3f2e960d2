"""Data-parallel vs DiLoCo vs Streaming DiLoCo at equal tokens, on the `stdlib` corpus.

    python bench/quality.py            # default: 4 workers x 700 steps, ~13 min on a quiet 2-core machine
    python bench/quality.py --quick    # 4 workers x 120 steps, H=20, ~2-3 min
    python bench/quality.py --out results.json

Every configuration trains the same model from the same init on the same data, with the
same number of tokens per worker; only the sync method differs. Prints a table and writes
JSON (commit and machine included). Also measures the 4-bit codec's encode/decode speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchutil import print_table, write_json  # noqa: E402

from peer.data import load_corpus  # noqa: E402
from peer.simulation import SimulationConfig, run_simulation  # noqa: E402
from protocol.errors import LocalProtocolError  # noqa: E402
from protocol.config import ConfigError, DataConfig, InnerConfig, SyncConfig, TrainConfig, model_preset  # noqa: E402


LIAR_SCALE = 1000.0
LIAR_FILL = 1e30  # the liar's row that sends a constant vector: every element 1e30


def configurations(H: int, P: int) -> list[tuple[str, SyncConfig, float, float, str]]:
    """The table's rows (mode, sync, liar scale, liar fill, liar aim): the baseline, plain DiLoCo, then Streaming
    DiLoCo's changes added one at a time (fragments, then 4-bit), then overlap (tau) and the
    mixing factor (alpha) varied one at a time, so a row never credits tau with what alpha
    did: tau=0 and tau=1 at alpha=0.5, and tau=1 at alpha=0 (the result replaces the local
    copy, as at tau=0 alpha=0). Every row averages with the robust (clipped) mean, the
    default; the last rows compare it with the plain mean, honest and with one lying worker
    that sends its pseudo-gradients x1000, and show the robust mean under one that sends 1e30
    in every element (a constant vector: clipped to an honest norm it would still push every
    weight the same way; ``protocol.butterfly.clip_scale`` gives it no weight). The last six
    weigh the clip itself, 1 (the default) beside 2: honest, and under a liar that stays within
    it, pushing a constant direction or its pseudo-gradient negated at twice its own norm
    (``peer.simulation.aimed``): the clip bounds a push's size, not where it points."""
    def s(tau: int, alpha: float, codec: str = "fp4", clip: float = 1.0) -> SyncConfig:
        return SyncConfig(inner_steps=H, fragments=P, overlap=tau, alpha=alpha, codec=codec, clip=clip)

    return [
        ("ddp", SyncConfig(method="ddp"), 0.0, 0.0, ""),
        ("diloco", SyncConfig(inner_steps=H, fragments=1, overlap=0, alpha=0.0, codec="fp32"), 0.0, 0.0, ""),
        ("streaming", s(0, 0.0, "fp32"), 0.0, 0.0, ""),
        ("streaming", s(0, 0.0), 0.0, 0.0, ""),
        ("streaming", s(0, 0.5), 0.0, 0.0, ""),
        ("streaming", s(1, 0.5), 0.0, 0.0, ""),
        ("streaming", s(1, 0.0), 0.0, 0.0, ""),
        ("streaming", s(5, 0.5), 0.0, 0.0, ""),
        ("streaming", s(1, 0.5, clip=0.0), 0.0, 0.0, ""),
        ("streaming", s(1, 0.5), LIAR_SCALE, 0.0, ""),
        ("streaming", s(1, 0.5, clip=0.0), LIAR_SCALE, 0.0, ""),
        ("streaming", s(1, 0.5), 0.0, LIAR_FILL, ""),
        ("streaming", s(1, 0.5, clip=2.0), 0.0, 0.0, ""),
        ("streaming", s(1, 0.5), 0.0, 0.0, "constant"),
        ("streaming", s(1, 0.5, clip=2.0), 0.0, 0.0, "constant"),
        ("streaming", s(1, 0.5), 0.0, 0.0, "negated"),
        ("streaming", s(1, 0.5, clip=2.0), 0.0, 0.0, "negated"),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="120 steps, H=20: the CI-sized run (< 3 min)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, help="inner steps per worker (default 700, quick 120)")
    ap.add_argument("-H", "--inner-steps", type=int, help="H (default 50, quick 20)")
    ap.add_argument("-P", "--fragments", type=int, default=2)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", help="comma-separated row numbers to run (1-based), e.g. 1,2")
    ap.add_argument("--out", help="JSON path (default bench/results/quality.json)")
    args = ap.parse_args()
    steps = args.steps or (120 if args.quick else 700)
    H = args.inner_steps or (20 if args.quick else 50)

    model = model_preset(args.preset)
    data = DataConfig(source="stdlib", seed=args.seed)
    inner = InnerConfig(lr=args.lr, warmup_steps=max(1, steps // 20), total_steps=steps, batch_size=args.batch_size)
    try:
        rows = configurations(H, args.fragments)
    except ConfigError as e:
        ap.error(f"{e} (the table has a tau=5 row: use H >= 6*P)")
    corpus = load_corpus(data, model.vocab_size)
    if args.only:
        keep = {int(i) for i in args.only.split(",")}
        rows = [r for i, r in enumerate(rows, 1) if i in keep]

    runs = []
    for mode, sync, liar, fill, aim in rows:
        tc = TrainConfig(model=model, data=data, inner=inner, sync=sync)
        sim = SimulationConfig(train=tc, workers=args.workers, steps=steps, eval_batches=16, liar_scale=liar,
                               liar_fill=fill, liar_aim=aim)
        aggregate = "-" if mode == "ddp" else f"clip {sync.clip:g}" if sync.clip else "mean"
        label = mode if mode == "ddp" else (f"{mode} P={sync.fragments} tau={sync.overlap} alpha={sync.alpha} "
                                            f"{sync.codec} {aggregate}" + (f" liar x{liar:g}" if liar else "")
                                            + (f" liar fills {fill:g}" if fill else "")
                                            + (f" liar aims {aim}" if aim else ""))
        print(f"running {label} ...", file=sys.stderr, flush=True)
        try:
            res = run_simulation(sim, corpus)
        except LocalProtocolError as e:  # the plain mean under a liar: the model became NaN
            print(f"  diverged: {e}", file=sys.stderr, flush=True)
            rec = {"tokens": 0, "bytes_sent_per_worker": 0, "peak_bytes_per_sync": 0, "wall_s": 0.0,
                   **(runs[-1] if runs else {}), "mode": mode, "alpha": sync.alpha, "aggregate": aggregate, "liar_scale": liar,
                   "liar_fill": fill, "liar_aim": aim, "fragments": sync.fragments, "tau": sync.overlap, "codec": sync.codec,
                   "heldout_loss": float("nan"), "train_loss": float("nan"), "history": [], "diverged": str(e)}
            runs.append(rec)
            continue
        rec = {"mode": mode, "alpha": sync.alpha if mode != "ddp" else float("nan"), "aggregate": aggregate,
               "liar_scale": liar, "liar_fill": fill, "liar_aim": aim,
               **{k: v for k, v in dataclasses.asdict(res).items() if k != "history"},
               "history": res.history}
        runs.append(rec)
        print(f"  held-out {res.heldout_loss:.4f}  sent {res.bytes_sent_per_worker / 1e6:.2f} MB  "
              f"peak {res.peak_bytes_per_sync / 1e6:.3f} MB  {res.wall_s:.0f} s", file=sys.stderr, flush=True)

    base = {r["mode"]: r for r in runs}
    for r in runs:
        r["loss_vs_ddp"] = r["heldout_loss"] / base["ddp"]["heldout_loss"] - 1 if "ddp" in base else float("nan")
        r["loss_vs_diloco"] = r["heldout_loss"] / base["diloco"]["heldout_loss"] - 1 if "diloco" in base else float("nan")
        r["bytes_vs_ddp"] = base["ddp"]["bytes_sent_per_worker"] / max(1, r["bytes_sent_per_worker"]) if "ddp" in base else float("nan")
        r["peak_vs_diloco"] = base["diloco"]["peak_bytes_per_sync"] / max(1, r["peak_bytes_per_sync"]) if "diloco" in base else float("nan")
    print()
    print(f"{args.workers} workers x {steps} inner steps, preset {args.preset}, H={H}, "
          f"{runs[0]['tokens']:,} tokens per run")
    print_table(runs, [("mode", "mode", ""), ("fragments", "P", "d"), ("tau", "tau", "d"), ("alpha", "alpha", ".1f"),
                       ("codec", "codec", ""), ("aggregate", "mean", ""), ("liar_scale", "liar x", "g"),
                       ("liar_fill", "liar fill", "g"), ("liar_aim", "liar aim", ""),
                       ("heldout_loss", "held-out", ".4f"), ("loss_vs_ddp", "vs ddp", "+.2%"),
                       ("loss_vs_diloco", "vs diloco", "+.2%"),
                       ("bytes_sent_per_worker", "bytes/worker", ",d"), ("bytes_vs_ddp", "ddp/this", ".0f"),
                       ("peak_bytes_per_sync", "peak/sync", ",d"), ("peak_vs_diloco", "diloco/this", ".2f"),
                       ("wall_s", "wall s", ".0f")])

    shipped = [r for r in runs if r["mode"] == "streaming" and r["tau"] == 1 and r["alpha"] == 0.5
               and r["aggregate"] == "clip 1" and not r["liar_scale"] and not r["liar_fill"] and not r["liar_aim"]]
    if shipped and "ddp" in base:
        r = shipped[0]
        print(f"\nloss gap to ddp at equal tokens ({r['tokens']:,} per run): streaming P={r['fragments']} tau=1 "
              f"alpha=0.5 {r['codec']} (the demo's sync) ends {r['loss_vs_ddp']:+.2%} from ddp "
              f"({r['heldout_loss']:.4f} vs {base['ddp']['heldout_loss']:.4f})")

    plain = [r for r in runs if r["aggregate"] == "mean" and not r["liar_scale"]]
    if shipped and plain:
        print(f"robust mean, honest workers: held-out {shipped[0]['heldout_loss']:.4f} vs plain mean "
              f"{plain[0]['heldout_loss']:.4f} ({shipped[0]['heldout_loss'] / plain[0]['heldout_loss'] - 1:+.2%})")

    def honest_at(aggregate: str) -> dict | None:
        return next((r for r in runs if r["mode"] == "streaming" and r["tau"] == 1 and r["alpha"] == 0.5
                     and r["codec"] == "fp4" and r["aggregate"] == aggregate and not r["liar_scale"]
                     and not r["liar_fill"] and not r["liar_aim"]), None)

    for aggregate in sorted({r["aggregate"] for r in runs if r["liar_aim"]}):
        honest = honest_at(aggregate)
        if honest:
            said = ", ".join(f"{r['liar_aim']} {r['heldout_loss'] / honest['heldout_loss'] - 1:+.2%}" for r in runs
                             if r["liar_aim"] and r["aggregate"] == aggregate)
            print(f"{aggregate}: honest {honest['heldout_loss']:.4f}; one liar aiming within the clip: {said}")

    from codec_speed import codec_throughput

    speed = [codec_throughput(name, numel=1 << 22) for name in ("fp4", "int8")]
    print()
    print_table(speed, [("codec", "codec", ""), ("encode_mb_s", "encode MB/s", ".0f"),
                        ("decode_mb_s", "decode MB/s", ".0f"), ("to_fp16_mb_s", "x.to(fp16) MB/s", ".0f")])
    path = write_json(args.out, "quality", {
        "args": vars(args), "steps": steps, "inner_steps": H, "runs": runs, "codec_speed": speed})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
