"""The robust mean's candidates side by side: how well each holds one lying worker of four, and
what it costs honest runs.

    python bench/robust_mean.py                      # 7 aggregates x 5 liars, ~14 min on 2 cores
    python bench/robust_mean.py --aggregates clip1,clip2 --liars honest,constant

Each run is ``peer.simulation``'s Streaming DiLoCo (4 workers, tiny preset, 120 steps, H=20,
P=2, tau=1, alpha=0.5, fp4) whose last worker lies the same way in every sync, and whose
parts' means are taken by one of:

  clipC    the robust mean's clip alone (``protocol.butterfly.clip_scales``) at ``sync.clip`` = C
           (``sync.gate`` false: clip1 is the default of runs made before the gate)
  clipCg   the shipped robust mean (``protocol.gate.robust_factors``): the clip at C, then
           the direction gate (the term pointing furthest against the others' sum counts for
           nothing, then the next, up to a third of the weight; the mean over the weight
           kept); clip1g is the default
  trim     a coordinate-wise trimmed mean: each element's largest and smallest value dropped
           (unweighted: the simulation's workers weigh alike)
  gateT    clip1, then each contribution whose cosine with the others' clipped mean (all but
           it) is below T counts for nothing, over the shares of those kept (all count when
           that would leave none), all at once and with no weight limit: the candidate
           measured before clip1g
  cclipC   a simple centred clipping (after Karimireddy et al., 2021): each push's deviation
           from the fragment's last mean, clipped to C x the lower median of the deviations'
           norms, one step, and no worker momentum (which their bound relies on)

The liars: ``honest`` (none), ``constant`` (every element alike, at twice the norm of its true
pseudo-gradient), ``negated`` (its pseudo-gradient x -2), ``alie`` (the honest pushes' mean
minus one standard deviation in every element: "a little is enough", Baruch et al., 2019)
and ``aimed`` (the honest pushes' mean negated, at twice its own norm; it sees the others'
pushes). Every part is encoded and decoded with the codec as on the wire. Prints held-out loss
per aggregate and liar, and each beside the same aggregate's honest run; writes JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchutil import print_table, write_json  # noqa: E402

import peer.simulation as simulation  # noqa: E402
from peer.data import load_corpus  # noqa: E402
from protocol.butterfly import clip_scales, slice_bounds  # noqa: E402
from protocol.gate import gram, robust_factors  # noqa: E402
from protocol.config import ConfigError, DataConfig, InnerConfig, SyncConfig, TrainConfig, model_preset  # noqa: E402

LIARS = ("honest", "constant", "negated", "alie", "aimed")
AGGREGATES = ("clip1g", "clip1", "clip2", "trim", "cclip1", "cclip2", "gate0")


def lie(vectors: list[torch.Tensor], how: str) -> list[torch.Tensor]:
    """The pushes with the last worker's replaced by its lie."""
    if how == "honest":
        return vectors
    own, honest = vectors[-1], torch.stack([v.double() for v in vectors[:-1]])
    if how in ("constant", "negated"):
        fake = simulation.aimed(own, how)  # as bench/quality.py's aimed liar
    elif how == "alie":
        fake = (honest.mean(0) - honest.std(0)).float()
    elif how == "aimed":
        m = honest.mean(0)
        fake = (-m / m.norm().clamp_min(1e-30) * 2.0 * float(own.norm())).float()
    else:
        raise ValueError(f"unknown liar {how!r}")
    return [*vectors[:-1], fake]


def part_mean(parts: list[torch.Tensor], shares: list[float], aggregate: str, centre: torch.Tensor) -> torch.Tensor:
    """One part's mean (float64) of the decoded ``parts`` under ``aggregate``."""
    if aggregate.startswith("clip") and aggregate.endswith("g"):
        scales, _ = robust_factors([float(p.norm()) for p in parts], shares, float(aggregate[4:-1]), True,
                                   lambda: gram([parts]))
        return sum(w * s * p for w, s, p in zip(shares, scales, parts))
    if aggregate.startswith("clip"):
        scales = clip_scales([float(p.norm()) for p in parts], float(aggregate[4:]))
        return sum(w * s * p for w, s, p in zip(shares, scales, parts))
    if aggregate.startswith("gate"):
        return gated_mean(parts, shares, float(aggregate[4:]))
    if aggregate == "trim":
        ordered = torch.stack(parts).sort(0).values
        return (ordered[1:-1] if len(parts) >= 4 else ordered).mean(0)
    if aggregate.startswith("cclip"):
        dev = [p - centre for p in parts]
        scales = clip_scales([float(d.norm()) for d in dev], float(aggregate[5:]))
        return centre + sum(w * s * d for w, s, d in zip(shares, scales, dev))
    raise ValueError(f"unknown aggregate {aggregate!r}")


def gated_mean(parts: list[torch.Tensor], shares: list[float], threshold: float) -> torch.Tensor:
    """``clip1``'s terms, less those whose cosine with the sum of the other terms is below
    ``threshold``, over the shares of those kept."""
    scales = clip_scales([float(p.norm()) for p in parts], 1.0)
    terms = [w * s * p for w, s, p in zip(shares, scales, parts)]
    total = sum(terms)
    keep = []
    for t, p in zip(terms, parts):
        rest = total - t
        keep.append(float(torch.dot(p, rest)) >= threshold * float(p.norm()) * float(rest.norm()))
    if not any(keep):
        keep = [True] * len(parts)
    return sum(t for t, k in zip(terms, keep) if k) / sum(w for w, k in zip(shares, keep) if k)


def patched_allreduce(aggregate: str, liar: str):
    last: dict[int, torch.Tensor] = {}  # per fragment (syncs alternate with P = 2): its last mean
    calls = [0]

    def allreduce(vectors, weights, codec, clip=0.0, gate=False):
        vectors = lie(list(vectors), liar)
        fragment = calls[0] % 2
        calls[0] += 1
        n, numel = len(vectors), vectors[0].numel()
        total = float(sum(weights))
        shares = [w / total for w in weights]
        out = torch.empty(numel, dtype=torch.float32)
        centre_all = last.get(fragment, torch.zeros(numel))
        for s, e in slice_bounds(numel, n):
            parts = [codec.decode(codec.encode(v[s:e]), e - s).double() for v in vectors]
            mean = part_mean(parts, shares, aggregate, centre_all[s:e].double())
            out[s:e] = codec.decode(codec.encode(mean.float()), e - s)
        last[fragment] = out.clone()
        return out, [0] * n

    return allreduce


def valid_clip(text: str) -> bool:
    try:
        return 1.0 <= float(text) <= 1e6
    except ValueError:
        return False


def valid_threshold(text: str) -> bool:
    try:
        return -1.0 <= float(text) < 1.0
    except ValueError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--aggregates", default=",".join(AGGREGATES))
    ap.add_argument("--liars", default=",".join(LIARS))
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("-H", "--inner-steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--out", help="JSON path (default bench/results/robust_mean.json)")
    args = ap.parse_args()
    aggregates, liars = args.aggregates.split(","), args.liars.split(",")
    for a in aggregates:
        if a.startswith("gate") and valid_threshold(a[4:]):
            continue
        clip = a[5:] if a.startswith("cclip") else a[4:].removesuffix("g") if a.startswith("clip") else None
        if a != "trim" and not (clip is not None and valid_clip(clip)):
            ap.error(f"unknown aggregate {a!r}: one of trim, clipC, clipCg, cclipC (C >= 1, e.g. clip1), gateT (-1 <= T < 1)")
    for liar in liars:
        if liar not in LIARS:
            ap.error(f"unknown liar {liar!r}: one of {', '.join(LIARS)}")
    if args.steps < 1 or args.inner_steps < 1 or args.batch_size < 1:
        ap.error("--steps, -H and --batch-size must be >= 1")

    model = model_preset("tiny")
    data = DataConfig(source="stdlib", seed=0)
    inner = InnerConfig(lr=3e-3, warmup_steps=max(1, args.steps // 20), total_steps=args.steps,
                        batch_size=args.batch_size)
    try:
        sync = SyncConfig(inner_steps=args.inner_steps, fragments=2, overlap=1, alpha=0.5, codec="fp4")
        cfg = simulation.SimulationConfig(train=TrainConfig(model=model, data=data, inner=inner, sync=sync),
                                          workers=4, steps=args.steps, eval_batches=16)
    except ConfigError as e:
        ap.error(f"{e} (P = 2 and tau = 1 need -H >= 4)")
    corpus = load_corpus(data, model.vocab_size)
    runs, shipped = [], simulation.allreduce
    try:
        for aggregate in aggregates:
            for liar in liars:
                print(f"running {aggregate} liar {liar} ...", file=sys.stderr, flush=True)
                simulation.allreduce = patched_allreduce(aggregate, liar)
                res = simulation.run_simulation(cfg, corpus)
                runs.append({"aggregate": aggregate, "liar": liar, "heldout_loss": res.heldout_loss,
                             "wall_s": res.wall_s})
    finally:
        simulation.allreduce = shipped
    honest = {r["aggregate"]: r["heldout_loss"] for r in runs if r["liar"] == "honest"}
    base = honest.get("clip1", honest.get(aggregates[0]))
    for r in runs:
        h = honest.get(r["aggregate"])
        r["vs_honest"] = r["heldout_loss"] / h - 1 if h else float("nan")
        r["vs_clip1_honest"] = r["heldout_loss"] / base - 1 if base else float("nan")
    print(f"\n4 workers x {args.steps} inner steps, tiny preset, H={args.inner_steps}, P=2, fp4; the last worker lies")
    print_table(runs, [("aggregate", "aggregate", ""), ("liar", "liar", ""), ("heldout_loss", "held-out", ".4f"),
                       ("vs_honest", "vs its honest", "+.2%"), ("vs_clip1_honest", "vs clip1 honest", "+.2%"),
                       ("wall_s", "wall s", ".0f")])
    path = write_json(args.out, "robust_mean", {"args": vars(args), "runs": runs})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
