"""What serving the global state costs a node at each landing, on CPU (issue 14 item 2).

A node serves the run's global state (every fragment's fp32 global copy and outer momentum) to
joiners, and publishes it anew at every fragment landing. Two ways, measured in the same run on
the same worker (its state: 2 x the model in fp32):

- ``loop``: a copy (``snapshot``) on the training thread, then the blob copied and hashed on
  the node's network event loop (``StateServer.publish``): how it was done;
- ``thread``: the blob copied straight from the worker's tensors on the training thread
  (``pack_state``), hashed in a worker thread (``StateServer.publish_packed``): how it is done.

Per way: the training thread's time, the longest the event loop went without running a
10 ms ticker (its averaging and every peer's frames wait that long), the time until the new
state is served, and the peak RSS above the node's before it. Each publish keeps the previous
state served, so the steady state holds two blobs either way; the peak is what differs.

    python bench/state_publish.py --preset 150m --repeats 3
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
    ap.add_argument("--repeats", type=int, default=3, help="publishes per way, alternating")
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
    for frag in worker.outer:  # outer momentum, as after the first outer step
        frag.opt.state[frag.global_flat]["momentum_buffer"] = torch.randn_like(frag.global_flat)
    state_mib = sum(2 * f.global_flat.numel() * 4 for f in worker.outer) / 2**20

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server = StateServer(None, Identity.generate(), b"\1" * 20, chunk_bytes=16 << 20)  # publishing needs no network
    lag = {"max": 0.0}

    async def ticker() -> None:
        while True:
            t = loop.time()
            await asyncio.sleep(0.01)
            lag["max"] = max(lag["max"], loop.time() - t - 0.01)

    ticking = asyncio.run_coroutine_threadsafe(ticker(), loop)
    rows = []
    for r in range(args.repeats):
        for way in ("loop", "thread"):
            gc.collect()
            time.sleep(0.2)
            worker.step += 1  # another state each time: a new digest, as at a landing
            with Peak() as peak:
                lag["max"] = 0.0
                t0 = time.perf_counter()
                if way == "loop":
                    state = snapshot(worker, [r + 1] * args.fragments)
                    coro = server.publish(state)
                else:
                    coro = server.publish_packed(pack_state(snapshot(worker, [r + 1] * args.fragments, copy=False)))
                trainer_s = time.perf_counter() - t0
                asyncio.run_coroutine_threadsafe(coro, loop).result()
                served_s = time.perf_counter() - t0
                del coro
                if way == "loop":
                    del state
                time.sleep(0.05)  # a tick after the publish: the lag it caused is recorded
            rows.append({"way": way, "repeat": r, "trainer_s": trainer_s, "served_s": served_s,
                         "loop_stall_s": lag["max"], "peak_rss_above_mib": (peak.peak - peak.base) / 2**20})
    ticking.cancel()
    time.sleep(0.05)
    loop.call_soon_threadsafe(loop.stop)
    print(f"preset {args.preset}: state (global + outer momentum) {state_mib:.0f} MiB")
    print_table(rows, [("way", "way", "<6"), ("repeat", "#", ">2d"), ("trainer_s", "training thread s", ">17.3f"),
                       ("served_s", "served after s", ">14.3f"), ("loop_stall_s", "event loop stall s", ">18.3f"),
                       ("peak_rss_above_mib", "peak RSS above MiB", ">18.0f")])

    def worst(way: str, key: str) -> float:
        return max(x[key] for x in rows if x["way"] == way)

    stall_ratio = worst("loop", "loop_stall_s") / max(worst("thread", "loop_stall_s"), 1e-6)
    peak_ratio = worst("loop", "peak_rss_above_mib") / max(worst("thread", "peak_rss_above_mib"), 1e-6)
    print(f"worst event-loop stall, loop / thread: {stall_ratio:.1f}x; worst peak RSS above, loop / thread: "
          f"{peak_ratio:.2f}x")
    path = write_json(args.out, "state_publish", {"args": vars(args), "state_mib": state_mib, "rows": rows,
                                                 "stall_ratio": stall_ratio, "peak_rss_ratio": peak_ratio})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
