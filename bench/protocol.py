"""Benchmark of the wire protocol: signing and verification rates, and how fast a 64 MiB
4-bit slice message is encoded, decoded, sealed and verified, next to a plain copy of the
same bytes.

    python bench/protocol.py                  # table on stdout, JSON in bench/results/
    python bench/protocol.py --slice-mib 256 --out /tmp/protocol.json

Each row is the best of ``--repeat`` runs (the machine may be shared). MiB/s is payload bytes
over wall time; a row faster than the copy does not copy the payload at all.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import cryptography  # noqa: E402
from benchutil import write_json  # noqa: E402
import msgpack  # noqa: E402

from protocol.envelope import seal, seal_parts, verify  # noqa: E402
from protocol.identity import Identity, verify_signature  # noqa: E402
from protocol.messages import decode, digest, encode, encode_parts  # noqa: E402
from protocol.messages_swarm import Heartbeat, PushSlice  # noqa: E402


def best_of(repeat: int, fn, *args) -> float:
    """Fastest wall time of ``repeat`` calls, in seconds."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return min(times)


def rate(seconds_budget: float, fn, *args) -> float:
    """Calls per second of ``fn`` over about ``seconds_budget`` seconds (best of 3 rounds)."""
    n = 1
    while True:  # find a batch that takes ~1/10 of the budget
        t = time.perf_counter()
        for _ in range(n):
            fn(*args)
        dt = time.perf_counter() - t
        if dt > seconds_budget / 10:
            break
        n *= 2
    per_round = max(1, int(n * (seconds_budget / 3) / dt))
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(per_round):
            fn(*args)
        best = max(best, per_round / (time.perf_counter() - t))
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slice-mib", type=int, default=64, help="payload size of the slice message (MiB)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per large-message row (best is kept)")
    parser.add_argument("--seconds", type=float, default=3.0, help="time budget per small-message rate")
    parser.add_argument("--out", type=Path, help="JSON path (default bench/results/protocol.json)")
    args = parser.parse_args()

    identity = Identity.from_seed(bytes(range(32)))
    rows: list[dict[str, object]] = []

    # Small messages: how many envelopes a peer can sign and check per second.
    hb = Heartbeat(run_id=b"r" * 20, sent_at=1.7e9, state="training", step=1000, tokens=128_000, tokens_per_s=5e3,
                   rounds=(10, 10, 9, 9), state_digest=b"d" * 32, reachable=True,
                   maddrs=(f"/ip4/203.0.113.7/tcp/31337/p2p/{identity.peer_id}",), client="swarmstream/0.1.0",
                   device="cuda NVIDIA H100")
    wire = seal(hb, identity)
    statement = b"x" * 100
    signature = identity.sign(statement)
    for name, fn, arg in [
        ("Ed25519 sign (100 B, raw)", identity.sign, statement),
        ("Ed25519 verify (100 B, raw)", lambda s: verify_signature(identity.public_key, signature, s), statement),
        ("seal Heartbeat (encode + sign)", lambda m: seal(m, identity), hb),
        ("verify Heartbeat (decode + verify)", verify, wire),
        ("encode Heartbeat", encode, hb),
        ("decode Heartbeat", decode, encode(hb)),
    ]:
        per_s = rate(args.seconds, fn, arg)
        rows.append({"case": name, "bytes": len(wire), "per_s": round(per_s), "us": round(1e6 / per_s, 1)})

    # One large fp4 slice, laid out as protocol.codecs does: per 32 elements, 16 bytes of codes
    # and a 2-byte scale. Its bytes are random: the protocol never looks inside a payload.
    blocks = (args.slice_mib << 20) // 18
    numel, size = 32 * blocks, 18 * blocks
    payload = os.urandom(size)
    msg = PushSlice(run_id=b"r" * 20, fragment=3, round=42, group_id=b"g" * 16, part=1, offset=0, numel=numel,
                    shape=(numel,), dtype="float32", codec="fp4", weight=65536.0, stopping=False, payload=payload)
    encoded = encode(msg)
    sealed = seal(msg, identity)
    big = [
        ("bytes copy (baseline)", lambda: bytes(memoryview(payload))),
        ("sha256 of the payload", lambda: digest(payload)),
        ("encode -> bytes (one copy)", lambda: encode(msg)),
        ("encode_parts (no copy)", lambda: encode_parts(msg)),
        ("decode (no copy)", lambda: decode(encoded)),
        ("seal -> bytes (hash + sign + copy)", lambda: seal(msg, identity)),
        ("seal_parts (hash + sign, no copy)", lambda: seal_parts(msg, identity)),
        ("verify (decode + hash + verify)", lambda: verify(sealed)),
    ]
    for name, fn in big:
        seconds = best_of(args.repeat, fn)
        rows.append({"case": f"{args.slice_mib} MiB fp4 slice: {name}", "bytes": size,
                     "ms": round(seconds * 1e3, 3), "mib_per_s": round(size / 2**20 / seconds, 1)})

    print(f"{'case':<62} {'rate':>16} {'time':>12}")
    for r in rows:
        if "per_s" in r:
            print(f"{r['case']:<62} {r['per_s']:>12,} /s {r['us']:>9} us")
        else:
            print(f"{r['case']:<62} {r['mib_per_s']:>10,} MiB/s {r['ms']:>9} ms")

    libs = {"msgpack": ".".join(map(str, msgpack.version)), "cryptography": cryptography.__version__}
    out = write_json(args.out, "protocol", {"libraries": libs, "args": {k: str(v) for k, v in vars(args).items()},
                                            "rows": rows})
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
