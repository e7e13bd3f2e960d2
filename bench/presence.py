"""Presence traffic per node as a run grows: one DHT key for every heartbeat against the
shards of ``peer.shards`` (issue 14 item 4).

Two parts:

- **real**: N hivemind DHT nodes in this process (each its own libp2p daemon, on 127.0.0.1),
  each with a ``peer.presence.Presence`` as a node has. Every interval each one announces its
  heartbeat and reads its view of the run, all at once, as nodes do every
  ``heartbeat_interval_s`` (here as fast as 2 cores manage; a heartbeat lives 4.5 times the
  last interval, as a run's 45 s do its 10 s, so records a node left at another level
  expire as they would). Per node and interval, averaged over every interval but the first
  (a node probes every level at its first read and every 7th: one probe in the average, as
  in every 7 reads): the heartbeat bytes its reads returned (the records' values as stored:
  what the DHT hands back to it, stale ones too) and its stores; at the last interval (not a
  probe), how many of the others it saw and how far its estimate of N is off.
  ``one key`` is a shard target no run reaches (every heartbeat under the run's one key, as
  before the shards); ``sharded`` is ``--target`` (8 by default here, so that 128 nodes
  spread over levels as 4,000 would at the real target of 32).
- **model**: ``peer.shards.simulate``, the same shard views against a dict standing in for the
  DHT, at the real target (32) up to ``--model-max`` peers: heartbeats read per node per
  interval, which with one key is N.

DHT routing (O(log N) hops per lookup, the same for both) is not in the byte counts: they
count the payload that the scheme decides.

    python bench/presence.py                      # real: 32, 64, 128 nodes; model: 100 .. 10,000
    python bench/presence.py --real 16 --model-max 1000 --intervals 6    # ~1 min
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchutil import print_table, write_json  # noqa: E402

ONE_KEY = 1 << 30  # a shard target that no run reaches: level 0, every heartbeat under one key


class Counting:
    """A DHT node's ``store_many`` / ``get_many``, counting what goes through them."""

    def __init__(self, dht):
        self.dht = dht
        self.read_bytes = 0
        self.stores = 0

    async def store_many(self, keys, values, *args, **kwargs):
        self.stores += len(keys)
        return await self.dht.store_many(keys, values, *args, **kwargs)

    async def get_many(self, keys, *args, **kwargs):
        found = await self.dht.get_many(keys, *args, **kwargs)
        for v in found.values():
            if v is not None and isinstance(v.value, dict):
                self.read_bytes += sum(len(x.value) for x in v.value.values() if isinstance(x.value, bytes))
        return found

    async def store(self, *args, **kwargs):
        self.stores += 1
        return await self.dht.store(*args, **kwargs)

    async def get(self, *args, **kwargs):
        return await self.dht.get(*args, **kwargs)


async def real_run(n: int, target: int, intervals: int, seed: int) -> dict:
    from hivemind.dht.node import DHTNode
    from hivemind.utils import get_dht_time

    from peer.presence import Presence
    from protocol.identity import Identity
    from protocol.messages_swarm import Heartbeat

    rng = random.Random(seed)
    run_id = rng.randbytes(20)
    nodes = [await DHTNode.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])]
    first = [str(a) for a in await nodes[0].get_visible_maddrs()]
    for i in range(1, n):
        peers = first if i < 4 else [str(a) for a in await nodes[rng.randrange(i)].get_visible_maddrs()]
        nodes.append(await DHTNode.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers))
    try:
        ids = [Identity.generate() for _ in nodes]
        counters = [Counting(d) for d in nodes]
        pres = [Presence(c, ident, shard_target=target) for c, ident in zip(counters, ids)]
        rows = []
        ttl = 120.0
        for t in range(intervals):
            for c in counters:
                c.read_bytes = c.stores = 0
            now = get_dht_time()
            hbs = [Heartbeat(run_id=run_id, sent_at=now, state="training", step=100 * t, tokens=10 ** 6,
                             tokens_per_s=1e4, rounds=(t, t), state_digest=rng.randbytes(32), reachable=True,
                             maddrs=(f"/ip4/203.0.113.{i % 250}/tcp/31337/p2p/{ident.peer_id}",),
                             client="swarmstream/bench", device="cpu") for i, ident in enumerate(ids)]
            t0 = time.monotonic()
            await asyncio.gather(*(p.announce(hb, ttl) for p, hb in zip(pres, hbs)))
            seen = await asyncio.gather(*(p.peers(run_id, ttl) for p in pres))
            rows.append({
                "interval": t, "seconds": time.monotonic() - t0,
                "read_kb": statistics.mean(c.read_bytes for c in counters) / 1e3,
                "read_kb_max": max(c.read_bytes for c in counters) / 1e3,
                "stores": statistics.mean(c.stores for c in counters),
                "seen_share": statistics.mean(len(set(s) - {ids[i].public_key}) / (n - 1) for i, s in enumerate(seen)),
                "levels": sorted({p.view(run_id).level for p in pres}),
                "estimate_low": min(p.estimate(run_id) for p in pres) / n,
                "estimate_high": max(p.estimate(run_id) for p in pres) / n,
            })
            ttl = max(120.0, 4.5 * rows[-1]["seconds"])
        steady = rows[1:8] or rows  # intervals 1..7: the 7th read of each node is a probe
        return rows[-1] | {"read_kb": statistics.mean(r["read_kb"] for r in steady),
                           "read_kb_max": max(r["read_kb_max"] for r in steady),
                           "seconds": statistics.mean(r["seconds"] for r in steady), "per_interval": rows}
    finally:
        for d in nodes:
            await d.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", default="32,64,128", help="real DHT node counts (comma-separated; '' for none)")
    ap.add_argument("--target", type=int, default=8, help="the shard target of the real runs' sharded rows")
    ap.add_argument("--intervals", type=int, default=9, help="heartbeat intervals per real run (9: probes at 0 and 7)")
    ap.add_argument("--model-max", type=int, default=10_000, help="largest run of the model part")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    real = []
    for n in [int(x) for x in args.real.split(",") if x]:
        for scheme, target in (("one key", ONE_KEY), ("sharded", args.target)):
            print(f"real DHT: {n} nodes, {scheme} ...", flush=True)
            r = asyncio.run(real_run(n, target, args.intervals, seed=n))
            real.append({"nodes": n, "scheme": scheme, "target": target if target != ONE_KEY else None,
                         "levels": "/".join(map(str, r["levels"])), **{k: v for k, v in r.items() if k != "levels"}})
    if real:
        print("\nreal DHT nodes on 127.0.0.1; per node and heartbeat interval (mean over all but the first; "
              "saw and N est: the last):")
        print_table(real, [("nodes", "N", ">5d"), ("scheme", "scheme", ">8s"), ("levels", "levels", ">6s"),
                           ("read_kb", "read KB", ">8.1f"), ("read_kb_max", "max KB", ">7.1f"),
                           ("stores", "stores", ">6.1f"), ("seen_share", "saw", ">5.2f"),
                           ("estimate_low", "N est lo", ">8.2f"), ("estimate_high", "N est hi", ">8.2f"),
                           ("seconds", "interval s", ">10.1f")])

    from peer.shards import SHARD_TARGET, simulate

    model = []
    for n in [x for x in (100, 300, 1000, 3000, 10_000, 30_000) if x <= args.model_max]:
        t0 = time.monotonic()
        s = simulate(n, 24, ramp=12)
        model.append({"peers": n, "one_key_read": n, "levels": "/".join(map(str, s.levels)),
                      "records_read": s.records_read, "records_read_max": s.records_read_max, "stores": s.stores,
                      "seen_share": s.seen_share, "estimate_low": s.estimate_low, "estimate_high": s.estimate_high,
                      "seconds": time.monotonic() - t0})
    print(f"\nmodel (peer.shards.simulate, target {SHARD_TARGET}, the run grows over 12 intervals, measured at 24):")
    print_table(model, [("peers", "N", ">6d"), ("one_key_read", "one key: read", ">13d"), ("levels", "levels", ">6s"),
                        ("records_read", "sharded: read", ">13.1f"), ("records_read_max", "max", ">5d"),
                        ("stores", "stores", ">6.1f"), ("seen_share", "saw", ">5.2f"),
                        ("estimate_low", "N est lo", ">8.2f"), ("estimate_high", "N est hi", ">8.2f")])
    out = write_json(args.out, "presence", {"args": vars(args), "real": real, "model": model})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
