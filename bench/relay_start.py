"""How long a peer behind a NAT takes to become reachable through a relay after it starts.

Three network namespaces on a bridge (``peer.netns``; root and iproute2): ``host`` listens on
its address (a run's first peer, ``--host-reachability``), ``volunteer`` listens only on its
own loopback (nobody can dial it: a volunteer behind a NAT, ``--reachability private``) and
bootstraps through the host (and ``--dead`` bootstrap addresses that nobody answers), and
``outsider`` keeps trying to open a connection to the volunteer through the host's circuit
(``Network.connect_relayed``, every 2 s), as a peer whose dial failed does. Each is a real
``peer.network.Network`` (its own libp2p daemon) in its own process.

``reachable_s``: from the volunteer's network being up to the outsider's first relayed
connection (at most ``--limit`` s). Modes, measured in the same run:

- ``static``: the relays are the bootstrap peers that answer at start (``NetworkConfig.static_relays``,
  the default): libp2p's autorelay reserves a slot on them at once.
- ``discovery``: libp2p's relay discovery (before): autorelay waits for 4 relay candidates or
  its 3-minute boot delay.

    python bench/relay_start.py                   # both modes, one host, no dead bootstrap peer (~4 min)
    python bench/relay_start.py --modes static --dead 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from benchutil import print_table, write_json  # noqa: E402

NS, SUBNET, PORT = "ssrs", "10.77.0", 44300
HOST, VOLUNTEER, OUTSIDER = 0, 1, 2

# one process per peer: ROLE ARGS... ; prints a JSON line when up
CHILD = r"""
import json, sys, time
from peer.network import Network, NetworkConfig
role, key, listen, reach, static, *rest = sys.argv[1:]
if role == "node":
    net = Network(NetworkConfig(identity_path=key, host_maddrs=(listen,), initial_peers=tuple(rest),
                                reachability=reach, static_relays=static == "1"))
    print(json.dumps({"peer_id": net.peer_id, "up": time.time()}), flush=True)
    while True:
        time.sleep(60)
else:  # outsider: rest = BOOT TARGET LIMIT CIRCUIT...
    boot, target, limit, *circuits = rest
    with Network(NetworkConfig(identity_path=key, host_maddrs=(listen,), initial_peers=(boot,),
                               client_mode=True, static_relays=static == "1")) as net:
        t0 = time.monotonic()
        ok = False
        while not (ok := net.call(net.connect_relayed(target, circuits), timeout=60)):
            if time.monotonic() - t0 > float(limit):
                break
            time.sleep(2)  # a dial that has nothing to wait on: bounded retries
        print(json.dumps({"connected": ok, "at": time.time()}), flush=True)
"""


def _spawn(i: int, args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", f"{NS}{i}", sys.executable, "-c", CHILD, *args],
                            stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))


def _first_line(proc: subprocess.Popen, what: str, timeout: float) -> dict:
    import select

    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        raise SystemExit(f"{what} did not start within {timeout:.0f} s (see its log)")
    return json.loads(line)


def measure(mode: str, dead: int, host_reach: str, limit: float, work: Path) -> dict:
    from peer import netns
    from peer.identity_store import load_or_create_identity

    netns.create(NS, SUBNET, 3)
    procs: list[subprocess.Popen] = []
    static = "1" if mode == "static" else "0"
    try:
        host_addr = f"/ip4/{SUBNET}.{HOST + 1}/tcp/{PORT}"
        procs.append(_spawn(HOST, ["node", str(work / "host.key"), host_addr, host_reach, static], work / "host.log"))
        host = _first_line(procs[-1], "the host", 60)
        boot = [f"{host_addr}/p2p/{host['peer_id']}"]
        boot += [f"/ip4/{SUBNET}.{OUTSIDER + 1}/tcp/{PORT + 90 + j}/p2p/"  # nobody listens there
                 f"{load_or_create_identity(work / f'dead{j}.key').peer_id}" for j in range(dead)]
        procs.append(_spawn(VOLUNTEER, ["node", str(work / "vol.key"), "/ip4/127.0.0.1/tcp/0", "private", static, *boot],
                            work / "volunteer.log"))
        vol = _first_line(procs[-1], "the volunteer", 60)
        circuit = f"{boot[0]}/p2p-circuit/p2p/{vol['peer_id']}"
        procs.append(_spawn(OUTSIDER, ["outsider", str(work / "out.key"), f"/ip4/{SUBNET}.{OUTSIDER + 1}/tcp/0", "auto",
                                       static, boot[0], vol["peer_id"], str(limit), circuit], work / "outsider.log"))
        out = _first_line(procs[-1], "the outsider", limit + 120)
        return {"mode": mode, "dead": dead, "host_reachability": host_reach, "connected": out["connected"],
                "reachable_s": round(out["at"] - vol["up"], 1) if out["connected"] else float("inf")}
    finally:
        for p in procs:
            p.kill()
            p.wait()
        netns.remove(NS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", choices=("static", "discovery"), default=["static", "discovery"])
    ap.add_argument("--dead", type=int, default=0, help="bootstrap addresses that nobody answers (default 0)")
    ap.add_argument("--host-reachability", choices=("auto", "public"), default="auto")
    ap.add_argument("--limit", type=float, default=300.0, help="give up after this many seconds (default 300)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("this benchmark builds network namespaces: run it as root (ip netns)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="ss-rs-", dir="/tmp") as tmp:  # short: unix socket paths
        for mode in args.modes:
            work = Path(tmp) / mode
            work.mkdir()
            rows.append(measure(mode, args.dead, args.host_reachability, args.limit, work))
            print(f"{mode}: {rows[-1]['reachable_s']} s", flush=True)
    print_table(rows, [("mode", "mode", ">10"), ("dead", "dead boot", ">9"), ("connected", "reached", ">7"),
                       ("reachable_s", "reachable s", ">11.1f")])
    path = write_json(args.out, "relay_start", {"args": vars(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    t0 = time.monotonic()
    main()
    print(f"({time.monotonic() - t0:.0f} s)")
