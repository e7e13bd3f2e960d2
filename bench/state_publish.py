"""What serving the global state costs a node at each landing, on CPU (issue 14 item 2).

A node serves the run's global state (every fragment's fp32 global copy and outer momentum) to
joiners, and publishes it anew at every fragment landing. Each repeat lands one fragment (an
outer step on it, fragments in turn), then publishes; two ways, on the same worker in the same
run (its swarm state: 2 x the model in fp32):

- ``copy``: a copy of the whole state on the training thread, every chunk hashed in a worker
  thread (``StateServer.publish_packed``): how it was done before the state was shared;
- ``shared``: the worker's own tensors (``snapshot(copy=False)``; its fragments copy on write),
  only the chunks of the fragment that landed hashed: how a node does it.

Per way: the training thread's time (the outer step and the publish's share of it), the time
until the new state is served, the longest the event loop went without running a 10 ms ticker,
the peak RSS above the node's before the landing, and the RSS above it once published (what
the server holds beyond the swarm state itself; no download is under way, so it holds no
previous state).

    python bench/state_publish.py --preset 150m --repeats 4
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchutil import print_table, write_json  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    """Peak RSS while it runs, sampled every 2 ms on its own thread."""

    def __enter__(self) -> Peak:
        self.base, self.peak, self._stop = rss_bytes(), 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_bytes())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="150m", help="model preset (default 150m)")
    ap.add_argument("--fragments", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=4, help="landings per way")
    ap.add_argument("--out", help="JSON path (default bench/results/state_publish.json)")
    args = ap.parse_args()
    if args.repeats < 1 or args.fragments < 1:
        raise SystemExit("--repeats and --fragments must be >= 1")

    import torch

    from peer.globalstate import pack_state, snapshot
    from peer.statesync import StateServer
    from peer.worker import Worker
    from protocol.config import PRESETS, SyncConfig, TrainConfig
    from protocol.identity import Identity

    if args.preset not in PRESETS:
        raise SystemExit(f"--preset must be one of {', '.join(PRESETS)}")
    train = TrainConfig(model=PRESETS[args.preset], sync=SyncConfig(method="diloco", fragments=args.fragments))
    worker = Worker(train, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for frag in worker.outer:  # outer momentum, as after the first outer step
        frag.step(torch.randn(frag.numel, generator=gen) * 1e-3)
    model_mib = 4 * train.model.num_params() / 2**20
    state_mib = sum(2 * f.global_flat.numel() * 4 for f in worker.outer) / 2**20

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    lag = {"max": 0.0}

    async def ticker() -> None:
        while True:
            t = loop.time()
            await asyncio.sleep(0.01)
            lag["max"] = max(lag["max"], loop.time() - t - 0.01)

    ticking = asyncio.run_coroutine_threadsafe(ticker(), loop)
    rows = []
    rounds = [1] * args.fragments
    for way in ("copy", "shared"):
        # a server per way, so that what one holds does not count against the other
        server = StateServer(None, Identity.generate(), b"\1" * 20, chunk_bytes=16 << 20)  # no network needed
        asyncio.run_coroutine_threadsafe(server.publish_packed(pack_state(snapshot(worker, rounds, copy=way == "copy"))),
                                         loop).result()
        for r in range(args.repeats):
            p = r % args.fragments
            gc.collect()
            time.sleep(0.2)
            base = rss_bytes()
            with Peak() as peak:
                lag["max"] = 0.0
                t0 = time.perf_counter()
                worker.apply_outer(p, torch.randn(worker.outer[p].numel, generator=gen) * 1e-3)  # a landing
                rounds[p] += 1
                packed = pack_state(snapshot(worker, rounds, copy=way == "copy"))
                trainer_s = time.perf_counter() - t0
                asyncio.run_coroutine_threadsafe(server.publish_packed(packed), loop).result()
                served_s = time.perf_counter() - t0
                del packed
                time.sleep(0.05)  # a tick after the publish: the lag it caused is recorded
            rows.append({"way": way, "repeat": r, "fragment": p, "trainer_s": trainer_s, "served_s": served_s,
                         "loop_stall_s": lag["max"], "peak_rss_above_mib": (peak.peak - base) / 2**20,
                         "held_above_mib": (rss_bytes() - base) / 2**20})
        held = rss_bytes()
        del server
        gc.collect()
        time.sleep(0.2)
        for row in rows[-args.repeats:]:  # what the server held beyond the swarm state, once published
            row["server_holds_mib"] = (held - rss_bytes()) / 2**20
    ticking.cancel()
    time.sleep(0.05)
    loop.call_soon_threadsafe(loop.stop)
    print(f"preset {args.preset}: fp32 model {model_mib:.0f} MiB; swarm state (global + outer momentum) "
          f"{state_mib:.0f} MiB = {state_mib / model_mib:.2f}x; {args.fragments} fragments")
    print_table(rows, [("way", "way", "<6"), ("repeat", "#", ">2d"), ("fragment", "landed", ">6d"),
                       ("trainer_s", "training thread s", ">17.3f"), ("served_s", "served after s", ">14.3f"),
                       ("loop_stall_s", "event loop stall s", ">18.3f"),
                       ("peak_rss_above_mib", "peak RSS above MiB", ">18.0f"),
                       ("server_holds_mib", "server holds MiB", ">16.0f")])

    def worst(way: str, key: str) -> float:
        return max(x[key] for x in rows if x["way"] == way)

    for way in ("copy", "shared"):
        total = state_mib + max(0.0, worst(way, "server_holds_mib"))
        print(f"{way}: swarm state + what the server holds = {total:.0f} MiB = {total / model_mib:.2f}x the fp32 "
              f"model; worst peak during a landing {state_mib + worst(way, 'peak_rss_above_mib'):.0f} MiB = "
              f"{(state_mib + worst(way, 'peak_rss_above_mib')) / model_mib:.2f}x")
    peak_ratio = worst("copy", "peak_rss_above_mib") / max(worst("shared", "peak_rss_above_mib"), 1e-6)
    served_ratio = worst("copy", "served_s") / max(worst("shared", "served_s"), 1e-6)
    print(f"worst peak RSS above, copy / shared: {peak_ratio:.2f}x; worst time to serve, copy / shared: "
          f"{served_ratio:.2f}x")
    path = write_json(args.out, "state_publish", {"args": vars(args), "model_mib": model_mib,
                                                 "state_mib": state_mib, "rows": rows, "peak_rss_ratio": peak_ratio,
                                                 "served_ratio": served_ratio})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
