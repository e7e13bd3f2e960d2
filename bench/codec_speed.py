"""Throughput of the wire codecs on this machine's CPU.

Encoding is on the critical path of every outer step, so a codec is only worth its bytes if
it encodes faster than the link sends them. Compare ``encode_mb_s`` with your upload speed
(in MB/s of fp32 input: an fp4 payload is 4.5/32 of that) and with ``to_fp16_mb_s``, the
speed of a plain ``x.to(torch.float16)``: the floor any codec can hope to reach.

    python bench/codec_speed.py                   # table for all codecs, 16 Mi elements
    python bench/codec_speed.py --numel 1048576 --out codec_speed.json   # JSON always written

MB/s here is 10**6 bytes of fp32 input (4 bytes per element) per second, best of ``repeats``.
Keep runs short on shared machines: each repeat touches a few hundred MB.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

# Runnable as a plain script from the repository root, without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchutil import write_json  # noqa: E402

from protocol.codecs import get_codec  # noqa: E402
from protocol.config import CODEC_NAMES  # noqa: E402


def _best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def codec_throughput(name: str, numel: int = 1 << 24, repeats: int = 3) -> dict:
    """Encode and decode MB/s of ``numel`` fp32 N(0, 1e-3^2) values (pseudo-gradient scale)."""
    codec = get_codec(name)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=gen) * 1e-3  # (numel,) float32
    data = codec.encode(x)  # warm-up, and the payload decode is timed on
    codec.decode(data, numel)
    mb = numel * 4 / 1e6  # fp32 input size in MB
    return {
        "codec": name,
        "numel": numel,
        "encode_mb_s": mb / _best_seconds(lambda: codec.encode(x), repeats),
        "decode_mb_s": mb / _best_seconds(lambda: codec.decode(data, numel), repeats),
        "to_fp16_mb_s": mb / _best_seconds(lambda: x.to(torch.float16), repeats),
        "bits_per_element": 8 * len(data) / max(numel, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 24, help="elements per tensor (default 16Mi = 64 MB fp32)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the best counts")
    ap.add_argument("--codecs", default=",".join(CODEC_NAMES), help="comma-separated codec names")
    ap.add_argument("--out", help="JSON path (default bench/results/codec_speed.json)")
    args = ap.parse_args(argv)

    rows = [codec_throughput(n, args.numel, args.repeats) for n in args.codecs.split(",")]
    print(f"{'codec':<6} {'bits/el':>8} {'encode MB/s':>12} {'decode MB/s':>12} {'to fp16 MB/s':>13}")
    for r in rows:
        print(f"{r['codec']:<6} {r['bits_per_element']:>8.3f} {r['encode_mb_s']:>12.0f} "
              f"{r['decode_mb_s']:>12.0f} {r['to_fp16_mb_s']:>13.0f}")
    print(f"wrote {write_json(args.out, 'codec_speed', {'numel': args.numel, 'results': rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
