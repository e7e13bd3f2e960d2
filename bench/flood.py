"""What one validly signed key that floods an averager costs its victim: memory.

A victim runs an ``Averager`` on a real libp2p daemon (127.0.0.1) and starts no round. An
attacker with one key opens ``--streams`` averaging streams to it at once and sends, on each,
``--frames`` signed ``PushSlice`` frames of ``--frame-mib`` MiB, every one for a group that
does not exist. The victim's resident memory (the Python process, sampled every 20 ms) is
reported as its growth over the idle baseline, with the averager's per-peer limits on (the
defaults) and off (limits as large as the totals, and any number of frame bodies in memory:
how the averager was before the limits per peer), in the same run:

    python bench/flood.py                      # table on stdout, JSON in bench/results/flood.json
    python bench/flood.py --streams 4,16 --frames 2 --frame-mib 60

The growth with limits on is bounded by the per-peer limits (32 streams, one frame body read
at a time, in chunks, a quarter of the early-frame buffer) whatever the attacker sends; with them off it
grows with the streams the attacker opens. A frame body is held a few times over while it is
read and verified (the stream's buffer, the frame, the envelope's body, the payload), so the
bound is several frames, not one. One run per row: the figure is a peak, not a rate.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from benchutil import print_table, write_json  # noqa: E402

CTX = mp.get_context("spawn")
RUN_ID = b"\x42" * 20
MIB = 1 << 20


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def victim(key: str, limits: bool, out_q, cmd_q) -> None:
    import torch

    from peer.allreduce import Averager
    from peer.identity_store import load_or_create_identity
    from peer.network import Network, NetworkConfig

    torch.set_num_threads(1)
    ident = load_or_create_identity(key)
    with Network(NetworkConfig(identity_path=key, host_maddrs=("/ip4/127.0.0.1/tcp/0",))) as net:
        frame = 64 * MIB
        kw = {} if limits else {"max_streams_per_peer": 10_000, "max_pending_groups_per_peer": 8,
                                "max_pending_bytes_per_peer": 4 * frame}
        av = Averager(net.p2p, ident, RUN_ID, max_frame_bytes=frame, **kw)
        if not limits:  # and any number of a peer's frame bodies in memory at once
            from peer.inbox import StreamGate

            av._gate = StreamGate(10_000, 10_000)
        net.call(av.start(), 30)
        peak, stop = [0], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], rss_bytes())
                stop.wait(0.02)

        base = rss_bytes()
        threading.Thread(target=sample, daemon=True).start()
        out_q.put(("ready", list(map(str, net.visible_maddrs())), ident.peer_id))
        cmd_q.get()  # the attacker is done
        stop.set()
        out_q.put(("rss", base, peak[0], av.pending.nbytes))
        net.call(av.shutdown(), 10)


def attacker(key: str, maddrs: list[str], victim_id: str, streams: int, frames: int, frame_mib: float,
             out_q) -> None:
    import asyncio

    import torch

    from peer.allreduce import Averager
    from peer.identity_store import load_or_create_identity
    from peer.network import Network, NetworkConfig
    from protocol.envelope import seal_parts
    from protocol.messages_swarm import PushSlice

    ident = load_or_create_identity(key)
    numel = int(frame_mib * MIB) // 4 // 256 * 256
    payload = torch.randn(numel).numpy().tobytes()
    with Network(NetworkConfig(identity_path=key, host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                               initial_peers=tuple(maddrs))) as net:
        av = Averager(net.p2p, ident, RUN_ID, max_frame_bytes=64 * MIB)

        def sealed(k: int) -> list:
            msg = PushSlice(run_id=RUN_ID, fragment=0, round=1, group_id=k.to_bytes(16, "big"), part=0, offset=0,
                            numel=numel, shape=(numel,), dtype="float32", codec="fp32", weight=1.0,
                            stopping=False, payload=payload)
            return seal_parts(msg, ident)

        async def flood() -> tuple[int, int]:
            async def one(s: int) -> int:
                try:
                    return await av._send_frames(victim_id, [sealed(s * frames + f) for f in range(frames)])
                except Exception:  # noqa: BLE001  (a refused stream is what the victim should do)
                    return 0

            sent = await asyncio.gather(*(one(s) for s in range(streams)))
            return sum(sent), sum(1 for b in sent if b)

        t0 = time.perf_counter()
        sent, accepted = net.call(flood(), 600)
        out_q.put(("sent", sent, accepted, time.perf_counter() - t0))


def run_one(tmp: Path, limits: bool, streams: int, args) -> dict:
    vq, vcmd, aq = CTX.Queue(), CTX.Queue(), CTX.Queue()
    v = CTX.Process(target=victim, args=(str(tmp / f"victim{limits}.key"), limits, vq, vcmd), daemon=True)
    v.start()
    try:
        _, maddrs, victim_id = vq.get(timeout=120)
        a = CTX.Process(target=attacker, args=(str(tmp / f"attacker{limits}.key"), maddrs, victim_id, streams,
                                               args.frames, args.frame_mib, aq), daemon=True)
        a.start()
        try:
            _, sent, accepted, seconds = aq.get(timeout=900)
        finally:
            a.join(30)
            if a.is_alive():
                a.kill()
        vcmd.put("done")
        _, base, peak, pending = vq.get(timeout=60)
    except queue.Empty:
        raise SystemExit("a benchmark process did not answer; see its output above") from None
    finally:
        v.join(30)
        if v.is_alive():
            v.kill()
    return {"limits": "per peer (default)" if limits else "totals only", "streams": streams,
            "sent_mib": sent / MIB, "growth_mib": (peak - base) / MIB, "pending_mib": pending / MIB,
            "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="4,16", help="concurrent streams the attacker opens (one row each)")
    ap.add_argument("--frames", type=int, default=2, help="frames per stream, each for a new group")
    ap.add_argument("--frame-mib", type=float, default=60.0, help="size of one frame (at most 64)")
    ap.add_argument("--out", help="JSON path (default bench/results/flood.json)")
    args = ap.parse_args()
    try:
        streams = [int(x) for x in args.streams.split(",")]
    except ValueError:
        raise SystemExit("--streams must be comma-separated integers, such as 4,16") from None
    if not (0 < args.frame_mib <= 63.9 and min(streams) >= 1 and args.frames >= 1):
        raise SystemExit("--frame-mib must be in (0, 63.9], --streams and --frames >= 1")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_one(Path(tmp), limits, n, args) for n in streams for limits in (False, True)]
    print_table(rows, [("limits", "limits", "<20"), ("streams", "streams", ">7d"), ("sent_mib", "sent MiB", ">9.0f"),
                       ("growth_mib", "victim RSS growth MiB", ">21.0f"), ("pending_mib", "buffered MiB", ">12.0f"),
                       ("seconds", "seconds", ">8.1f")])
    ratios = {}
    for off, on in zip(rows[::2], rows[1::2]):
        ratios[off["streams"]] = off["growth_mib"] / max(on["growth_mib"], 1e-9)
        print(f"{off['streams']} streams: growth without per-peer limits / with them: {ratios[off['streams']]:.2f}x")
    path = write_json(args.out, "flood", {"args": vars(args), "rows": rows, "growth_ratio_by_streams": ratios})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
