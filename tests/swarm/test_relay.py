"""A peer that nobody can dial trains with the swarm, and can be reached through relays.

Five real nodes, each in its own network namespace on a bridge (10.78.0.0/24). Peers 0-3 listen
on their namespace's address and say they are publicly reachable, which makes them relays too.
Peer 4 stands for a volunteer behind a NAT: it listens only on its namespace's loopback, so no
other peer can open a connection to it; it dials out. It holds relay reservations on its
bootstrap peers (libp2p's autorelay) and announces `/p2p-circuit` addresses through them in its
heartbeat. It must say it is `relayed`, average in groups with the others, be reachable through
a relay by a peer outside the swarm that has no other way to it, and hold the same global
fragment as everyone after a round they all landed together."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from peer import netns
from peer.demo import Demo
from peer.identity_store import load_or_create_identity
from protocol.messages_control import FinishAndStop, GetStatus
from swarm_util import Events, shared_landings
from tui.control_client import call

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

N = 5
PRIVATE = N - 1
PROBE = N  # one more namespace, for a peer outside the swarm that reaches PRIVATE through a relay
NS, SUBNET, PORT = "ssrelay", "10.78.0", 43100


@pytest.fixture
def namespaces():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        if os.environ.get("CI"):
            pytest.fail("this test needs root and iproute2 (ip netns) to build its network")
        pytest.skip("needs root and iproute2 (ip netns): CI runs it")
    netns.create(NS, SUBNET, N + 1)  # one more namespace, for the probe
    yield
    netns.remove(NS)


@pytest.mark.timeout(1000)  # three bounded waits: a first round (240 s), the probe (330 s), a clean round (240 s)
def test_a_peer_nobody_can_dial_trains_through_relays(namespaces, demos):
    workdir = Path(tempfile.mkdtemp(prefix="ss-relay-", dir="/tmp"))  # short: unix socket paths
    public = {i: f"/ip4/{SUBNET}.{i + 1}/tcp/{PORT + i}" for i in range(PRIVATE)}
    ids = {i: load_or_create_identity(workdir / f"peer{i}.key").peer_id for i in range(N)}
    listen = {**public, PRIVATE: "/ip4/127.0.0.1/tcp/0"}  # its own loopback: undialable from outside
    args = {i: ["--reachability", "public"] for i in public}
    # the private peer bootstraps through every public peer: each becomes one of its relays
    args[PRIVATE] = ["--reachability", "private",
                     "--initial-peers", *(f"{public[i]}/p2p/{ids[i]}" for i in range(1, PRIVATE))]
    events = Events()
    demo = Demo(N, rounds=None, workdir=workdir, on_event=events, listen=listen, args=args,
                launcher={i: ["ip", "netns", "exec", f"{NS}{i}"] for i in range(N)})
    demos.append(demo)
    demo.start()

    sock = demo.control_path(PRIVATE)
    # it averages in groups with the others, over the connections it opened to them
    events.wait_for(lambda i, ev: i == PRIVATE and ev.get("event") == "synced" and not ev["alone"],
                    timeout=240)
    st = call(sock, GetStatus)
    assert st.reachability == "relayed", st.reachability
    assert st.peers == N

    # a peer outside the swarm, in a namespace of its own, has no way to it but a relay: it
    # connects through one of the public peers' circuits (autorelay picks which hold its
    # reservations) and asks for the state it serves, over that connection
    circuits = [f"{public[i]}/p2p/{ids[i]}/p2p-circuit/p2p/{ids[PRIVATE]}" for i in public]
    probe = subprocess.run(["ip", "netns", "exec", f"{NS}{PROBE}", sys.executable, str(HERE / "relay_probe.py"),
                            str(workdir / "probe.key"), f"/ip4/{SUBNET}.{PROBE + 1}/tcp/0", f"{public[0]}/p2p/{ids[0]}",
                            demo.address.split(":", 1)[1].split("@", 1)[0], ids[PRIVATE], *circuits],
                           capture_output=True, text=True, timeout=330, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert json.loads(probe.stdout.strip().splitlines()[-1]) == {"connected": True, "answered": True}, probe.stderr[-3000:]

    # a round that all five landed in one group, entering it with one copy of the fragment:
    # one result on all five, bit for bit (copies that differ after a round with a dropped
    # member are compared and repaired afterwards, by design, and such a landing is not counted)
    everyone = tuple(range(N))
    events.drain()
    if not shared_landings(events.seen, everyone):
        events.wait_for(lambda i, e: bool(shared_landings(events.seen, everyone)), timeout=240)
    shared = shared_landings(events.seen, everyone)
    assert all(len(d) == 1 for d in shared.values()), f"members of a group landed different results: {shared}"
    for i in range(N):
        call(demo.control_path(i), FinishAndStop)
    summary = demo.wait()
    assert summary["errors"] == [] and summary["finished"] == N
