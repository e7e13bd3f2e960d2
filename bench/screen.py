"""How often the in-round screen of reduced parts (``protocol.butterfly.screen_mean``) refuses
an honest mean, and how often it catches a reducer's lie, on the pseudo-gradients of a real
run (the simulation: the same arithmetic as the swarm, ``peer.simulation.reduce_part``).

At every fragment sync of a simulated run, for each part of each group: the honest mean, and
lies a reducer could tell in its place (negated; x1.5; x3; another part's mean of the same
size; negated with the mean withheld from one member, which then cannot say its dot), each
screened as every member would screen it from the reports, with the reducer's own slice
vouched for by its two witnesses (``witnesses_of``, as the swarm does) and without (as it did
before them); and the honest mean with one member (a witness) reporting false dots (negated,
x10), which must not make it fail. Also the pairwise cosine of the
members' slices, which decides how much room a negation leaves.

    python bench/screen.py                        # tiny preset, 4 workers, H=50, P=2, fp4
    python bench/screen.py --workers 3 --codec fp32 --out /tmp/s.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchutil import print_table, write_json  # noqa: E402
from peer import simulation  # noqa: E402
from peer.data import load_corpus  # noqa: E402
from peer.simulation import SimulationConfig, run_simulation  # noqa: E402
from protocol.butterfly import screen_mean, slice_bounds, slice_norm, witnessed, witnesses_of  # noqa: E402
from protocol.config import DataConfig, InnerConfig, SyncConfig, TrainConfig, model_preset  # noqa: E402

LIES = ("honest", "honest, one false dot", "negated", "x1.5", "x3", "another part", "negated, one silent")


def screened(mean: torch.Tensor, payload: bytes, codec, clip: float, weights, j: int, slices, silent=None,
             framer=None, witnesses: bool = True) -> bool:
    """Whether every member keeps the part (the screen passes), as ``Round.inconsistent`` decides.
    ``silent`` did not say its dot (nor vouch, as a witness); ``framer`` reported its dots
    (and its vouch, as a witness) negated and x10. ``witnesses``: as the swarm screens now,
    with the reducer's own slice vouched for by its witnesses (``witnesses_of``; a fixed
    group ID), else as it did before them."""
    n = len(slices)
    others = [i for i in range(n) if i != j]
    dots = {i: float(torch.dot(mean.double(), slices[i].double())) for i in range(n)}
    lied = {i: -10 * d for i, d in dots.items()}
    vouched = [(w, slice_norm(slices[j]), lied[j] if w == framer else dots[j])
               for w in (witnesses_of(j, n, b"g" * 16) if witnesses and witnessed(n, clip) else ()) if w != silent]
    return screen_mean(slice_norm(mean), codec.error_bound(payload, mean.numel()), clip, weights[j],
                       [(weights[i], slice_norm(slices[i]), None if i == silent else lied[i] if i == framer else dots[i])
                        for i in others], reporters=others, vouched=vouched)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("-H", "--inner-steps", type=int, default=50)
    ap.add_argument("-P", "--fragments", type=int, default=2)
    ap.add_argument("--codec", default="fp4")
    ap.add_argument("--clip", type=float, default=2.0)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--out", help="JSON path (default bench/results/screen.json)")
    args = ap.parse_args()
    if args.workers < 2:
        ap.error("--workers must be 2 or more: a group of one reduces nothing")

    model = model_preset(args.preset)
    data = DataConfig(source="stdlib", seed=0)
    inner = InnerConfig(lr=3e-3, warmup_steps=max(1, args.steps // 20), total_steps=args.steps, batch_size=16)
    sync = SyncConfig(method="diloco", inner_steps=args.inner_steps, fragments=args.fragments, overlap=0,
                      codec=args.codec, clip=args.clip)
    tc = TrainConfig(model=model, data=data, inner=inner, sync=sync)
    kept = {(lie, w): [] for lie in LIES for w in (False, True)}
    cosines: list[float] = []
    real = simulation.allreduce

    def watched(vectors, weights, codec, clip=0.0):
        n = len(vectors)
        total = float(sum(weights))
        shares = [w / total for w in weights]
        parts = []
        for j, (s, e) in enumerate(slice_bounds(vectors[0].numel(), n)):
            payload, slices, _ = simulation.reduce_part(vectors, shares, j, codec, clip)
            parts.append((payload, slices, codec.decode(payload, e - s)))
            cosines.extend(float(torch.nn.functional.cosine_similarity(slices[a], slices[b], dim=0))
                           for a in range(n) for b in range(a + 1, n) if a != j and b != j)
        for j, (payload, slices, mean) in enumerate(parts):
            other = parts[(j + 1) % n][2]
            other = other[:mean.numel()] if other.numel() >= mean.numel() else torch.cat([other, other[:1]])
            told = {"honest": mean, "honest, one false dot": mean, "negated": -mean, "x1.5": 1.5 * mean, "x3": 3 * mean,
                    "another part": other * (slice_norm(mean) / max(slice_norm(other), 1e-30)),
                    "negated, one silent": -mean}
            for lie, m in told.items():
                p = payload if lie.startswith("honest") else codec.encode(m)
                # the member lied about or silent is a witness of j where j has them
                silent = witnesses_of(j, n, b"g" * 16)[0] if lie.endswith("silent") and n > 2 else (
                    (j + 1) % n if lie.endswith("silent") else None)
                framer = witnesses_of(j, n, b"g" * 16)[0] if lie.endswith("false dot") and n > 2 else (
                    (j + 1) % n if lie.endswith("false dot") else None)
                for w in (False, True):
                    kept[lie, w].append(screened(codec.decode(p, m.numel()), p, codec, clip, weights, j, slices,
                                                 silent, framer, w))
        return real(vectors, weights, codec, clip)

    simulation.allreduce = watched
    corpus = load_corpus(data, model.vocab_size)
    print(f"{args.workers} workers x {args.steps} steps, preset {args.preset}, H={args.inner_steps}, "
          f"P={args.fragments}, {args.codec}, clip {args.clip:g} ...", file=sys.stderr, flush=True)
    run_simulation(SimulationConfig(train=tc, workers=args.workers, steps=args.steps, eval_batches=2), corpus)

    rows = [{"told": lie, "witnesses": "two" if w else "none", "parts": len(v), "kept": sum(v),
             "refused_share": 1 - sum(v) / max(1, len(v))}
            for (lie, w), v in kept.items()]
    print_table(rows, [("told", "what the reducer sent", "s"), ("witnesses", "witnesses", "s"), ("parts", "parts", "d"),
                       ("kept", "kept", "d"), ("refused_share", "refused", ".0%")])
    cos = {"median": statistics.median(cosines), "min": min(cosines), "max": max(cosines)} if cosines else {}
    if cos:
        print(f"cosine of two members' slices: median {cos['median']:.2f}, range {cos['min']:.2f} to {cos['max']:.2f}")
    out = write_json(args.out, "screen", {"args": vars(args), "rows": rows, "cosine": cos})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
