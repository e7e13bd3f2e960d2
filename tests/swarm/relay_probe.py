"""A throwaway peer for test_relay: run inside its own network namespace, it joins through a
bootstrap peer, connects to a target peer only through that peer's relay (circuit) addresses,
and asks it for the index of the state it serves, over a stream on that relayed connection.

    python relay_probe.py KEY LISTEN BOOTSTRAP RUN_ID TARGET_PEER_ID CIRCUIT_MADDR...

Prints one JSON line: {"connected": bool, "answered": bool}."""

from __future__ import annotations

import json
import logging
import sys
import time


def main() -> None:
    from peer.network import Network, NetworkConfig
    from peer.statesync import current_indexes
    from protocol.manifest import parse_run_id

    # why each relayed dial failed goes to stderr, which test_relay shows when this fails
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    key, listen, boot, run_id, target, *maddrs = sys.argv[1:]
    with Network(NetworkConfig(identity_path=key, host_maddrs=(listen,), initial_peers=(boot,),
                               client_mode=True)) as net:
        # the target's relay reservations are made as it starts, on its bootstrap peers that
        # answered then (peer.network: its static relays); one that was slow to start on a busy
        # machine is not among them, and the reservations on the others come first. Try for a
        # while (bench/relay_start.py measures how long it takes)
        deadline = time.monotonic() + 240  # within test_relay's own wait for this process
        while not (connected := net.call(net.connect_relayed(target, maddrs), timeout=60)):
            if time.monotonic() > deadline:
                break
            time.sleep(2)  # bounded retries of a dial that has nothing to wait on
        served = net.call(current_indexes(net.p2p, net.identity, parse_run_id(run_id), [target], timeout_s=20),
                          timeout=40) if connected else {}
    print(json.dumps({"connected": connected, "answered": target in served}), flush=True)


if __name__ == "__main__":
    main()
