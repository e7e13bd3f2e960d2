"""Would witnesses let small groups refuse a wrong mean before it lands? (issue 12; a design
study, not the round's code.)

Today the in-round screen (``protocol.butterfly.screen_mean``) has two unknowns: the reducer's
own slice, which only the reducer knows, and one member whose report may be false. In groups
of 3-4 they leave room for a negated mean (``bench/screen.py``). With *witnesses*, the reducer
sends its own slice, encoded like any push, to ``w`` other members and averages that encoded
slice; each witness reports the mean's dot with it like its own.

What decides whether that helps: a witness is a member, and the screen must allow any one
member to lie, the witness included, in *all* of its reports at once. With one witness, the
world in which the witness lies has both unknowns again, so the screen refuses no more than
it does today in groups of 3-4 (an earlier version of this study counted the witness's two
reports as two members' and overstated it). With two witnesses whose reports agree, every
world keeps the reducer's term known through the witness that does not lie.

This simulates 0, 1 and 2 witnesses on synthetic pseudo-gradients (k slices of pairwise
correlation ``rho``, norms within 10%, equal weights; the generator of
``tests/unit/test_mean_screen.py``), fp4, clip 2, with the screen's own code (``screen_mean``
and its vouches): per group size and correlation, how many means of each kind every member
refuses. ``falsedot``: the member after the reducer (the first witness) reports minus three
times each of its true dots, in its own entry and in its vouch. ``foreign``: another part's
mean, cut to this part's length. ``gated``: the mean over every member but the one before the
reducer (clipped), which an honest reducer returns under the gate when it takes that member
out: with ``--gate`` it must never be refused. ``x0.2``: the mean shrunk; ``own``: the
reducer's own slice alone. The swarm uses two (``protocol.butterfly.WITNESSES``); a
reducer cannot send its two witnesses different slices without proving its lie, since its
mean commits to the one it averages (``SliceAveraged.own``).

    python bench/witness.py                  # groups of 3-6, rho 0.3 and 0.73, 12 seeds (~3 min)
    python bench/witness.py --clip 1 --gate  # the defaults of a new run: what the gate's room costs the screen
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from benchutil import print_table, write_json  # noqa: E402

from peer import simulation  # noqa: E402
from protocol.butterfly import clip_scales, screen_mean, slice_bounds, slice_norm  # noqa: E402
from protocol.codecs import get_codec  # noqa: E402

N = 640
KINDS = ("honest", "gated", "falsedot", "negated", "x0.2", "own", "x1.5", "x3", "foreign")


def group(seed: int, k: int, rho: float, spread: float = 1.1) -> list[torch.Tensor]:
    """k pseudo-gradients of N elements, pairwise correlation about ``rho``, norms up to
    ``spread`` apart."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(N, generator=g)
    return [(math.sqrt(rho) * common + math.sqrt(1 - rho) * torch.randn(N, generator=g))
            * float(1 + (spread - 1) * torch.rand(1, generator=g)) for _ in range(k)]


def refusals(k: int, rho: float, seeds: int, witnesses: int, codec_name: str = "fp4", clip: float = 2.0,
             gate: bool = False) -> dict:
    """Per kind of mean: [refused, screened] over every part of ``seeds`` groups, as every
    member screens it (``screen_mean``) with the reducer's own slice vouched for by
    ``witnesses`` members (the first ones after it; 0: as the swarm did before witnesses);
    ``gate``: the reducer gates and the screen allows for it (``sync.gate``)."""
    codec = get_codec(codec_name)
    out = {kind: [0, 0] for kind in KINDS}
    for seed in range(seeds):
        vecs = group(seed, k, rho)
        bounds = slice_bounds(N, k)
        for j, (s, e) in enumerate(bounds):
            # the reducer averages its own slice as encoded, as its witnesses get it
            payload, slices, _ = simulation.reduce_part(vecs, [1.0 / k] * k, j, codec, clip, gate)
            mean = codec.decode(payload, e - s)
            s2, e2 = bounds[(j + 1) % k]
            other = torch.stack([v[s2:e2] for v in vecs]).mean(0)
            # the mean a gating reducer returns when it takes out the last member (honest under the
            # gate, in groups of 3 or more; a lie without it)
            out_one = (j - 1) % k
            scales = clip_scales([slice_norm(x) for x in slices], clip)
            gated = torch.stack([scales[i] * slices[i] for i in range(k) if i != out_one]).sum(0) / (k - 1)
            told = {"honest": mean, "gated": gated, "falsedot": mean, "negated": -mean, "x0.2": 0.2 * mean,
                    "own": slices[j], "x1.5": 1.5 * mean, "x3": 3 * mean, "foreign": torch.cat([other, other])[: e - s]}
            wits = [(j + 1 + t) % k for t in range(witnesses)]
            others = [i for i in range(k) if i != j]
            for kind, m in told.items():
                data = codec.encode(m)
                m = codec.decode(data, e - s)
                norms = [slice_norm(x) for x in slices]
                dots = [float(torch.dot(m.double(), x.double())) for x in slices]
                liar = (j + 1) % k if kind == "falsedot" else None  # a witness, where there are any
                said = [-3.0 * abs(d) for d in dots]
                ok = screen_mean(slice_norm(m), codec.error_bound(data, e - s), clip, 1.0,
                                 [(1.0, norms[i], said[i] if i == liar else dots[i]) for i in others],
                                 reporters=others,
                                 vouched=[(w, norms[j], said[j] if w == liar else dots[j]) for w in wits], gate=gate)
                out[kind][0] += not ok
                out[kind][1] += 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="3,4,5,6", help="group sizes (default 3,4,5,6)")
    ap.add_argument("--rho", default="0.3,0.73", help="pairwise correlations (default 0.3,0.73: a real run's median)")
    ap.add_argument("--seeds", type=int, default=12, help="groups per cell (default 12)")
    ap.add_argument("--clip", type=float, default=2.0, help="the run's sync.clip (default 2, as first measured)")
    ap.add_argument("--gate", action="store_true", help="with the direction gate (sync.gate, on in new runs)")
    ap.add_argument("--out", help="JSON path (default bench/results/witness.json)")
    args = ap.parse_args()
    try:
        sizes = [int(x) for x in args.sizes.split(",")]
        rhos = [float(x) for x in args.rho.split(",")]
    except ValueError:
        ap.error("--sizes takes integers and --rho numbers, comma-separated, such as --sizes 4,5 --rho 0.73")
    if any(k < 2 for k in sizes) or any(not 0 <= r < 1 for r in rhos) or args.seeds < 1:
        ap.error("--sizes must be >= 2, --rho in [0, 1), --seeds >= 1")
    if not 1.0 <= args.clip <= 1e6:
        ap.error(f"--clip must be in [1, 1e6] (the screen needs a clip), got {args.clip}")
    rows = []
    for k in sizes:
        for rho in rhos:
            for witnesses in (0, 1, 2):
                r = refusals(k, rho, args.seeds, witnesses, clip=args.clip, gate=args.gate)
                rows.append({"k": k, "rho": rho, "witnesses": witnesses,
                             **{kind: f"{r[kind][0]}/{r[kind][1]}" for kind in KINDS}})
                print(f"group of {k}, rho {rho}, {witnesses} witness(es): done", flush=True)
    print(f"\nmeans refused by the screen (fp4, clip {args.clip:g}, gate {'on' if args.gate else 'off'}, equal weights), "
          "with 0, 1 or 2 witnesses")
    print_table(rows, [("k", "k", "d"), ("rho", "rho", ".2f"), ("witnesses", "witnesses", "d")]
                + [(kind, kind, "s") for kind in KINDS])
    out = write_json(args.out, "witness", {"codec": "fp4", "clip": args.clip, "gate": args.gate, "seeds": args.seeds,
                                           "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
