"""What an audit under the direction gate costs when colluders place their pushes on the gate's
line (issue 12).

An auditor cannot know the reducer's float rounding, so a contribution whose dot with the
others' sum is within a rounding of 0 may have been gated or not, and the audit recomputes the
mean for every set of gated contributions such choices allow (``protocol.gate.Gate.possible``,
at most ``GATE_CHOICES``). Colluders can put their pushes exactly on the line: here they push
on elements nobody else uses, so every dot is exactly 0. This times ``protocol.audit.check`` of
one reducer's part, honest and negated, with and without such colluders, as ratios to the
audit of the honest part without them, measured in the same run.

    python bench/audit_cost.py                       # 11 members, 9 colluders, 500,000 elements
    python bench/audit_cost.py --elements 4000000 --members 8
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from benchutil import print_table, write_json  # noqa: E402

import protocol.audit as audit  # noqa: E402
from peer.allreduce import Group  # noqa: E402
from peer.allreduce_round import Round  # noqa: E402
from peer.audit import inputs_frames  # noqa: E402
from protocol.codecs import get_codec  # noqa: E402
from protocol.envelope import seal, verify  # noqa: E402
from protocol.gate import Gate  # noqa: E402
from protocol.identity import Identity, peer_id_from_public_key  # noqa: E402
from protocol.messages_swarm import PushSlice, SliceAveraged  # noqa: E402

RUN = b"\x07" * 20
CHUNK = 65536
CODEC = "fp4"


class CountingGate(Gate):
    """The audit's gate, counting the sets it hands the audit."""
    last = 0

    def possible(self):
        out = super().possible()
        CountingGate.last = -1 if out is None else len(out)
        return out


def vectors(n: int, part: int, colluders: int, seed: int = 0) -> list[torch.Tensor]:
    """n whole vectors (n parts of ``part`` elements): honest members push correlated values on
    the first half of each part, each colluder on its own block of the second half."""
    g = torch.Generator().manual_seed(seed)
    honest = n - colluders
    half = part // 2 if colluders else part
    block = (part - half) // max(1, colluders) // 256 * 256
    out = []
    common = torch.randn(half, generator=g)
    for i in range(n):
        v = torch.zeros(n * part)
        for p in range(n):
            a = p * part
            if i < honest:
                v[a:a + half] = common + torch.randn(half, generator=g)
            else:
                b = a + half + (i - honest) * block
                v[b:b + block] = torch.randn(block, generator=g)
        out.append(v)
    return out


def one_audit(vecs: list[torch.Tensor], keys: list[Identity], negate: bool) -> tuple[str, int, float]:
    """Member 0 reduces part 0 (clip 1, gate on) and signs it, negated or not; an auditor checks
    it. -> (verdict, sets the gate allows, seconds of ``check``)."""
    n, codec = len(vecs), get_codec(CODEC)
    g = Group(run_id=RUN, fragment=1, round=3, group_id=b"a" * 16, members=tuple(k.public_key for k in keys[:n]),
              weights=tuple([1.0] * n), numel=vecs[0].numel(), codec=CODEC, deadline_s=5.0)
    rnd = Round(g, 0, vecs[0], codec, 1.0, chunk=CHUNK, gate=True)
    s, e = rnd.bounds[0]

    def frames(i: int) -> list[bytes]:
        return [seal(PushSlice(run_id=RUN, fragment=1, round=3, group_id=g.group_id, part=0, offset=a,
                               numel=min(a + CHUNK, e) - a, shape=(min(a + CHUNK, e) - a,), dtype="float32",
                               codec=CODEC, weight=1.0, stopping=False,
                               payload=codec.encode(vecs[i][a:min(a + CHUNK, e)])), keys[i])
                for a in range(s, e, CHUNK)]

    for i in range(1, n):
        for f in frames(i):
            rnd.accept(peer_id_from_public_key(keys[i].public_key), verify(f), len(f), f)
    rnd.own([(a, min(a + CHUNK, e), codec.encode(vecs[0][a:min(a + CHUNK, e)])) for a in range(s, e, CHUNK)],
            [[f] for f in frames(0)])
    mean, contrib, total = rnd.reduce()
    inputs = rnd.commit(contrib)
    if negate:
        mean = -mean
    means = [seal(SliceAveraged(run_id=RUN, fragment=1, round=3, group_id=g.group_id, part=0, offset=a,
                                numel=min(a + CHUNK, e) - a, shape=(min(a + CHUNK, e) - a,), dtype="float32",
                                codec=CODEC, weight=total, contributors=contrib, inputs=inputs,
                                own=rnd.own_digests()[a], payload=codec.encode(mean[a - s:min(a + CHUNK, e) - s])),
                  keys[0]) for a in range(s, e, CHUNK)]
    shown = [b"".join(bytes(x) for x in f) for f in inputs_frames(rnd)]
    CountingGate.last = 0
    t = time.perf_counter()
    verdict, _, _ = audit.check(means, shown, RUN, 1.0, gate=True)
    return verdict, CountingGate.last, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, default=500_000, help="elements of the audited part (default 500,000)")
    ap.add_argument("--members", type=int, default=11, help="group size (default 11)")
    ap.add_argument("--colluders", type=int, help="members pushing on the line (default: all but two)")
    ap.add_argument("--repeats", type=int, default=3, help="audits timed per row, the median kept (default 3)")
    ap.add_argument("--out", help="JSON path (default bench/results/audit_cost.json)")
    args = ap.parse_args()
    colluders = args.members - 2 if args.colluders is None else args.colluders
    if not 3 <= args.members <= 64 or not 0 <= colluders <= args.members - 1:
        ap.error("--members must be in 3..64 and --colluders in 0..members-1")
    if not 4096 <= args.elements <= 100_000_000 or args.repeats < 1:
        ap.error("--elements must be in 4,096..100,000,000 and --repeats >= 1")
    audit.Gate = CountingGate
    logging.getLogger("peer.allreduce").setLevel(logging.ERROR)  # the colluders' clipped slices
    keys = [Identity.from_seed(bytes([0x40 + i]) * 32) for i in range(args.members)]
    rows = []
    for on_line in (0, colluders):
        vecs = vectors(args.members, args.elements, on_line)
        for negate in (False, True):
            runs = [one_audit(vecs, keys, negate) for _ in range(args.repeats)]
            rows.append({"colluders": on_line, "mean": "negated" if negate else "honest", "verdict": runs[0][0],
                         "sets": runs[0][1], "seconds": statistics.median(r[2] for r in runs)})
            print(f"{on_line} colluders, {rows[-1]['mean']}: done", flush=True)
    base = rows[0]["seconds"]
    for r in rows:
        r["x_honest"] = r["seconds"] / base
    print(f"\naudit of one part ({args.elements:,} elements, {CODEC}, clip 1, gate on, {args.members} members)")
    print_table(rows, [("colluders", "colluders on the line", "d"), ("mean", "mean", "s"), ("verdict", "verdict", "s"),
                       ("sets", "sets possible", "d"), ("seconds", "seconds", ".3f"), ("x_honest", "x honest audit", ".2f")])
    out = write_json(args.out, "audit_cost", {"elements": args.elements, "members": args.members, "codec": CODEC,
                                              "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
