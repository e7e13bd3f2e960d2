"""Would a witness let small groups refuse a wrong mean before it lands? (issue 12; a design
study, not the round's code.)

Today the in-round screen (``protocol.butterfly.screen_mean``) has two unknowns: the reducer's
own slice, which only the reducer knows, and one member whose report may be false. In groups
of 4-5 they leave room for a negated mean (``bench/screen.py``). With a *witness*, the reducer
sends its own slice, encoded like any push, to one other member and averages that encoded
slice; the witness reports the mean's dot with it like its own. The reducer's term is then a
report like any other, and the screen keeps only the one false report it already allows.

This simulates both on synthetic pseudo-gradients (k slices of pairwise correlation ``rho``,
norms within 10%, equal weights; the generator of ``tests/unit/test_mean_screen.py``), fp4,
clip 2, the screen's own code: per group size and correlation, how many means of each kind
every member refuses. ``falsedot``: one member reports minus three times its true dot.
``foreign``: another part's mean, cut to this part's length.

    python bench/witness.py                  # groups of 3-6, rho 0.3 and 0.73, 12 seeds (~2 min)
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
from protocol.butterfly import screen_mean, slice_bounds, slice_norm  # noqa: E402
from protocol.codecs import get_codec  # noqa: E402

N = 640
KINDS = ("honest", "falsedot", "negated", "x1.5", "x3", "foreign")


def group(seed: int, k: int, rho: float, spread: float = 1.1) -> list[torch.Tensor]:
    """k pseudo-gradients of N elements, pairwise correlation about ``rho``, norms up to
    ``spread`` apart."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(N, generator=g)
    return [(math.sqrt(rho) * common + math.sqrt(1 - rho) * torch.randn(N, generator=g))
            * float(1 + (spread - 1) * torch.rand(1, generator=g)) for _ in range(k)]


def refusals(k: int, rho: float, seeds: int, witness: bool, codec_name: str = "fp4", clip: float = 2.0) -> dict:
    """Per kind of mean: [refused, screened] over every part of ``seeds`` groups."""
    codec = get_codec(codec_name)
    out = {kind: [0, 0] for kind in KINDS}
    for seed in range(seeds):
        vecs = group(seed, k, rho)
        bounds = slice_bounds(N, k)
        for j, (s, e) in enumerate(bounds):
            if witness:  # the reducer averages its own slice as encoded, as the witness sees it
                vecs_j = [v.clone() for v in vecs]
                vecs_j[j][s:e] = codec.decode(codec.encode(vecs[j][s:e]), e - s)
            else:
                vecs_j = vecs
            payload, slices, _ = simulation.reduce_part(vecs_j, [1.0 / k] * k, j, codec, clip)
            mean = codec.decode(payload, e - s)
            s2, e2 = bounds[(j + 1) % k]
            other = torch.stack([v[s2:e2] for v in vecs]).mean(0)
            foreign = torch.cat([other, other])[: e - s]
            told = {"honest": mean, "falsedot": mean, "negated": -mean, "x1.5": 1.5 * mean, "x3": 3 * mean,
                    "foreign": foreign}
            members = [i for i in range(k) if witness or i != j]  # with a witness, j's term is reported
            for kind, m in told.items():
                data = codec.encode(m)
                m = codec.decode(data, e - s)
                reports = [(1.0, slice_norm(slices[i]), float(torch.dot(m.double(), slices[i].double())))
                           for i in members]
                if kind == "falsedot":
                    w, n, d = reports[-1]
                    reports[-1] = (w, n, -3.0 * abs(d))
                ok = screen_mean(slice_norm(m), codec.error_bound(data, e - s), clip, 0.0 if witness else 1.0,
                                 reports)
                out[kind][0] += not ok
                out[kind][1] += 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="3,4,5,6", help="group sizes (default 3,4,5,6)")
    ap.add_argument("--rho", default="0.3,0.73", help="pairwise correlations (default 0.3,0.73: a real run's median)")
    ap.add_argument("--seeds", type=int, default=12, help="groups per cell (default 12)")
    ap.add_argument("--out", help="JSON path (default bench/results/witness.json)")
    args = ap.parse_args()
    try:
        sizes = [int(x) for x in args.sizes.split(",")]
        rhos = [float(x) for x in args.rho.split(",")]
    except ValueError:
        ap.error("--sizes takes integers and --rho numbers, comma-separated, such as --sizes 4,5 --rho 0.73")
    if any(k < 2 for k in sizes) or any(not 0 <= r < 1 for r in rhos) or args.seeds < 1:
        ap.error("--sizes must be >= 2, --rho in [0, 1), --seeds >= 1")
    rows = []
    for k in sizes:
        for rho in rhos:
            for witness in (False, True):
                r = refusals(k, rho, args.seeds, witness)
                rows.append({"k": k, "rho": rho, "screen": "witness" if witness else "today",
                             **{kind: f"{r[kind][0]}/{r[kind][1]}" for kind in KINDS}})
                print(f"group of {k}, rho {rho}, {rows[-1]['screen']}: done", flush=True)
    print("\nmeans refused by the screen (fp4, clip 2, equal weights), today and with a witness")
    print_table(rows, [("k", "k", "d"), ("rho", "rho", ".2f"), ("screen", "screen", "s")]
                + [(kind, kind, "s") for kind in KINDS])
    out = write_json(args.out, "witness", {"codec": "fp4", "clip": 2.0, "seeds": args.seeds, "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
